"""CPU profiles: run a command as if the CPU had only the instruction sets of a smaller one.

``python -m alignopsd.engine.commands.cpu_profile avx2 -- COMMAND ...`` (engine/commands/cpu_profile.py) runs
``COMMAND`` with the environment of the profile (``make run-avx2`` is ``make run`` under ``avx2``): every library of
the run that picks its kernels by the CPU's features is held to AVX2, and ``model.dtype: auto`` sees a CPU without
native bf16.

Each library dispatches on its own, so each needs its own variable, read when it first computes (hence the
profile is applied to a new process, never to one that already imported torch):

- ``ATEN_CPU_CAPABILITY=avx2``: torch's own vectorised kernels (``torch.backends.cpu.get_cpu_capability()`` then
  says ``AVX2``);
- ``MKL_ENABLE_INSTRUCTIONS=AVX2``: MKL's GEMM (fp32 matmuls, the linear layers);
- ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN (bf16 and some quantized kernels);
- ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``: FBGEMM, torch's int8 GEMM (``torch.ops.quantized.linear_dynamic``, the int8
  generation forward: engine/generation/int8.py). It reads the CPU itself (cpuinfo) and takes none of the above:
  without it an AVX-512 VNNI machine keeps its ``vpdpbusd`` kernels under the profile, where an AVX2 CPU forms the
  products of adjacent lanes in saturating int16 (``vpmaddubsw``); the same full-range product then differs
  (tests/engine/test_cpu_profile.py), and int8's measured gain would not be an AVX2 CPU's;
- ``ALIGNOPSD_CPU_FLAGS=""``: the dtype rule (engine/parallel/hardware.py) sees no native bf16, so ``auto`` is
  float32 as on an AVX2-only CPU.

What a profile cannot change: the core count, caches and memory bandwidth of the machine it runs on.
"""

from __future__ import annotations

import os

PROFILES: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "ALIGNOPSD_CPU_FLAGS": "",
    },
}


def profile_env(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the variables of profile ``name`` set; ValueError naming
    the known profiles for an unknown one."""
    if name not in PROFILES:
        raise ValueError(f"cpu profile: unknown {name!r}; known: {', '.join(sorted(PROFILES))}")
    env = dict(os.environ if base is None else base)
    env.update(PROFILES[name])
    return env
