"""Build script for the ``alignopsd`` distribution.

Maps the design card's folders to import names (``kernels/`` -> ``alignopsd.kernels``,
``engine/`` -> ``alignopsd.engine``) and builds ``csrc/`` into ``alignopsd._C`` with
pybind11. When no C++ compiler is usable the extension is skipped and the package falls
back to its Python paths (it says so once at import).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

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


# environment families: every package folder under engine/envs/ (its skill bank, if any, in its skills/ folder), found
# here so that adding an environment's folder needs no edit of this file
ENVS = Path(__file__).resolve().parent / "engine" / "envs"
ENV_FAMILIES = sorted(p.parent.name for p in ENVS.glob("*/__init__.py"))
# the skill banks are data folders, declared as (namespace) packages so that their files are installed
SKILL_PACKAGES = [f"alignopsd.engine.envs.{f}.skills" for f in ENV_FAMILIES if (ENVS / f / "skills").is_dir()]

setup(
    packages=[
        "alignopsd",
        "alignopsd.kernels",
        "alignopsd.engine",
        "alignopsd.engine.envs",
        "alignopsd.engine.models",
        "alignopsd.engine.commands",
        "alignopsd.engine.config",
        "alignopsd.engine.parallel",
        "alignopsd.engine.run",
        "alignopsd.engine.step",
        "alignopsd.engine.policy",
        "alignopsd.engine.generation",
        "alignopsd.engine.policy.megatron",
        *(f"alignopsd.engine.envs.{family}" for family in ENV_FAMILIES),
        *SKILL_PACKAGES,
    ],
    package_dir={
        "alignopsd": "alignopsd",
        "alignopsd.kernels": "kernels",
        "alignopsd.engine": "engine",
        "alignopsd.engine.envs": "engine/envs",
        "alignopsd.engine.models": "engine/models",
        "alignopsd.engine.commands": "engine/commands",
        "alignopsd.engine.config": "engine/config",
        "alignopsd.engine.parallel": "engine/parallel",
        "alignopsd.engine.run": "engine/run",
        "alignopsd.engine.step": "engine/step",
        "alignopsd.engine.policy": "engine/policy",
        "alignopsd.engine.generation": "engine/generation",
        "alignopsd.engine.policy.megatron": "engine/policy/megatron",
        **{f"alignopsd.engine.envs.{family}": f"engine/envs/{family}" for family in ENV_FAMILIES},
    },
    package_data={name: ["*.md", "*.json"] for name in SKILL_PACKAGES},
    ext_modules=ext_modules,
    cmdclass={"build_ext": OptionalBuildExt},
)
