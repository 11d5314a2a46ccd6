"""Build the compiled hot path: every csrc/_<name>.pyx becomes lumen_core._<name>.

The compiled module and its pure-Python twin share a name (``lumen_core._descriptor`` /
``lumen_core.descriptor``; see lumen_core/native.py), so the source is named like the module
it builds.  LUMEN_NO_EXTENSIONS=1 at build time skips compilation (the twins are used).  On
Linux the extensions are built without debug info and linked stripped (``-g0``, ``-s``).
"""
import glob
import os
import sys

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("LUMEN_NO_EXTENSIONS", "") not in ("1", "true", "yes"):
    import numpy
    from Cython.Build import cythonize

    # -g0 at compile time and -s at link time: the shipped extensions carry no debug info or
    # symbol tables (Python's own CFLAGS may add -g).  LUMEN_DEBUG_BUILD=1 keeps them.
    debug = os.environ.get("LUMEN_DEBUG_BUILD", "") in ("1", "true", "yes")
    strip = sys.platform.startswith("linux") and not debug
    compile_args = ["-O3"] + (["-g0"] if strip else [])
    link_args = ["-s"] if strip else []

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
                extra_compile_args=compile_args,
                extra_link_args=link_args,
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            )
        )
    ext_modules = cythonize(
        exts,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )

setup(ext_modules=ext_modules)
