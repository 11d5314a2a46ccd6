"""Build the compiled hot path: every csrc/_<name>.pyx becomes lumen_core._<name>, and every
lumen_core/_<name>.pxd compiles lumen_core/<name>.py into lumen_core._<name>.

The compiled module and its pure-Python twin share a name (``lumen_core.request_path._descriptor`` /
``lumen_core.request_path.descriptor``; see lumen_core/native.py), so the source is named like the module
it builds.  Two kinds of source: a ``csrc/_<name>.pyx`` is C-level code with its own twin
(buffer protocol, nogil loops); a ``lumen_core/_<name>.pxd`` beside ``lumen_core/<name>.py``
is Cython's pure-Python mode -- one source, the ``.py``, which is itself the pure twin and is
compiled with the types the ``.pxd`` declares (the request path's classes).  LUMEN_NO_EXTENSIONS=1 at build time skips compilation (the twins are used).  On
Linux the extensions are built without debug info and linked stripped (``-g0``, ``-s``).
"""
import glob
import os
import sys

from setuptools import Extension, setup

ext_modules = []


def twin_package(stem: str) -> str:
    """The package of csrc/<stem>.pyx's module: the one its pure twin ``<name>.py`` is in."""
    found = glob.glob(os.path.join("lumen_core", "**", stem[1:] + ".py"), recursive=True)
    if len(found) != 1:
        raise SystemExit(f"csrc/{stem}.pyx: expected one pure twin {stem[1:]}.py under "
                         f"lumen_core/, found {found or 'none'}")
    return os.path.dirname(found[0]).replace(os.sep, ".")

if os.environ.get("LUMEN_NO_EXTENSIONS", "") not in ("1", "true", "yes"):
    import numpy
    from Cython.Build import cythonize

    # -g0 at compile time and -s at link time: the shipped extensions carry no debug info or
    # symbol tables (Python's own CFLAGS may add -g).  LUMEN_DEBUG_BUILD=1 keeps them.
    debug = os.environ.get("LUMEN_DEBUG_BUILD", "") in ("1", "true", "yes")
    strip = sys.platform.startswith("linux") and not debug
    compile_args = ["-O3"] + (["-g0"] if strip else [])
    link_args = ["-s"] if strip else []

    sources = []
    for pyx in sorted(glob.glob(os.path.join("csrc", "*.pyx"))):
        stem = os.path.splitext(os.path.basename(pyx))[0]
        if not stem.startswith("_"):
            raise SystemExit(f"{pyx}: compiled sources are named csrc/_<name>.pyx after the "
                             f"module lumen_core._<name> they build")
        sources.append((twin_package(stem), stem, pyx))
    for pxd in sorted(glob.glob(os.path.join("lumen_core", "**", "_*.pxd"), recursive=True)):
        stem = os.path.splitext(os.path.basename(pxd))[0]
        py = os.path.join(os.path.dirname(pxd), stem[1:] + ".py")
        if not os.path.isfile(py):
            raise SystemExit(f"{pxd}: declares the compiled twin of {py}, which does not exist")
        sources.append((os.path.dirname(pxd).replace(os.sep, "."), stem, py))
    print(f"lumen-core: compiling {len(sources)} Cython extensions "
          f"({', '.join(stem for _pkg, stem, _src in sources)}); this takes about a minute",
          flush=True)

    exts = []
    for package, stem, src in sources:
        exts.append(
            Extension(
                f"{package}.{stem}",
                [src],
                depends=sorted(glob.glob(os.path.join("csrc", "*.h"))
                               + glob.glob(os.path.join("csrc", "*.pxd"))
                               + glob.glob(os.path.join("lumen_core", "**", "_*.pxd"),
                                           recursive=True)),
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
        # always regenerate the C: Cython's own dependency check misses a .pxd cimported by
        # another module's .pxd (_dispatch.pxd -> _scheduler.pxd), and a stale dispatch.c
        # built against an older Admission fails at import ("size changed")
        force=True,
    )

setup(ext_modules=ext_modules)
