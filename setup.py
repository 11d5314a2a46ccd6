"""Build the compiled hot path: every csrc/_<name>.pyx becomes lumen_core._<name>.

The compiled module and its pure-Python twin share a name (``lumen_core._descriptor`` /
``lumen_core.descriptor``; see lumen_core/native.py), so the source is named like the module
it builds.  LUMEN_NO_EXTENSIONS=1 at build time skips compilation (the twins are used).
"""
import glob
import os

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("LUMEN_NO_EXTENSIONS", "") not in ("1", "true", "yes"):
    import numpy
    from Cython.Build import cythonize

    exts = []
    for pyx in sorted(glob.glob(os.path.join("csrc", "*.pyx"))):
        stem = os.path.splitext(os.path.basename(pyx))[0]
        if not stem.startswith("_"):
            raise SystemExit(f"{pyx}: compiled sources are named csrc/_<name>.pyx after the "
                             f"module lumen_core._<name> they build")
        exts.append(
            Extension(
                f"lumen_core.{stem}",
                [pyx],
                depends=sorted(glob.glob(os.path.join("csrc", "*.h"))
                               + glob.glob(os.path.join("csrc", "*.pxd"))),
                include_dirs=["csrc", numpy.get_include()],
                extra_compile_args=["-O3"],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            )
        )
    ext_modules = cythonize(
        exts,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )

setup(ext_modules=ext_modules)
