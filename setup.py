"""Build script for the ``alignopsd`` distribution.

The package list and its folders come from the tree, so a new subpackage or data folder needs no edit here. The
design card's three folders are the distribution's roots (``ROOTS``: ``alignopsd/`` -> ``alignopsd``, ``kernels/``
-> ``alignopsd.kernels``, ``engine/`` -> ``alignopsd.engine``); every folder below a root with an ``__init__.py`` is
a package, and every folder holding data files (``DATA_SUFFIXES``: an environment's skill bank) but no
``__init__.py`` is a data package whose files are installed with it. ``csrc/`` is built into ``alignopsd._C`` with
pybind11. When no C++ compiler is usable the extension is skipped and the package falls back to its Python paths
(it says so once at import).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# `python setup.py ...` puts this folder first on sys.path, where the top-level kernels/ folder would hide the
# installed distribution of that name (setuptools loads its egg_info writer, `kernels._internals...`): nothing
# here is imported from the source tree
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from setuptools import setup  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402

# import name -> folder (relative to this file) of each root of the distribution
ROOTS = {"alignopsd": "alignopsd", "alignopsd.kernels": "kernels", "alignopsd.engine": "engine"}
# files installed from a folder without __init__.py (a data folder), by suffix
DATA_SUFFIXES = (".md", ".json", ".yaml", ".txt")


def tree_packages(roots: dict[str, str] = ROOTS) -> tuple[list[str], dict[str, list[str]]]:
    """(package names, package data) of every folder under ``roots``: a folder with ``__init__.py`` is a package, a
    folder of data files (``DATA_SUFFIXES``) without one is a data package installed with all those files."""
    packages: list[str] = []
    data: dict[str, list[str]] = {}
    for name, folder in roots.items():
        base = HERE / folder
        for d in sorted(p for p in [base, *base.rglob("*")] if p.is_dir()):
            rel = d.relative_to(base).parts
            if any(part.startswith((".", "_")) or part == "__pycache__" for part in rel):
                continue
            dotted = ".".join([name, *rel])
            files = [f for f in d.iterdir() if f.is_file()]
            if (d / "__init__.py").is_file():
                packages.append(dotted)
            elif any(f.suffix in DATA_SUFFIXES for f in files):
                packages.append(dotted)
                data[dotted] = [f"*{s}" for s in DATA_SUFFIXES]
    return packages, data


try:
    from pybind11.setup_helpers import Pybind11Extension

    ext_modules = [
        Pybind11Extension(
            "alignopsd._C",
            sorted(["csrc/alignopsd_C.cpp", "csrc/attention_bf16.cpp", "csrc/lm_head_bf16.cpp"]),
            depends=["csrc/bf16_tile.h", "csrc/errors.h"],
            cxx_std=17,
            extra_compile_args=["-O3", "-ffp-contract=off"],  # no fused multiply-add: bit-identical to Python
        )
    ]
except ImportError:  # pybind11 missing: pure-Python install
    ext_modules = []


class OptionalBuildExt(build_ext):
    """Build the C++ extension, but never fail the install because of it."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001
            print(f"alignopsd: C++ extension not built ({exc}); using the Python path", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"alignopsd: C++ extension not built ({exc}); using the Python path", file=sys.stderr)


if __name__ == "__main__":
    PACKAGES, PACKAGE_DATA = tree_packages()
    setup(
        packages=PACKAGES,
        package_dir=dict(ROOTS),  # a subpackage's folder follows from its root's (alignopsd.engine.run -> engine/run)
        package_data=PACKAGE_DATA,
        ext_modules=ext_modules,
        cmdclass={"build_ext": OptionalBuildExt},
    )
