"""Build the compiled hot path: every csrc/<name>.pyx becomes lumen_core._<name>.

LUMEN_NO_EXTENSIONS=1 at build time skips compilation (the pure-Python twins are used).
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
        name = os.path.splitext(os.path.basename(pyx))[0]
        exts.append(
            Extension(
                f"lumen_core._{name}",
                [pyx],
                depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),
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
