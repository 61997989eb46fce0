"""What the machine computes natively, and the parameter dtype ``auto`` picks from it.

``model.dtype: auto`` (and the reference model's and the thinking encoder's, which follow the same rule) picks
bfloat16 where the hardware has native bf16 arithmetic and float32 everywhere else:

* CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)`` (compute capability 8.0 and up);
* CPU: the feature flags of the first processor in ``/proc/cpuinfo`` -- x86 ``avx512_bf16`` or ``amx_bf16``
  (``flags``), Arm ``bf16`` (``Features``). Without them PyTorch emulates bf16 with conversions, which on a 2-core
  AVX2 machine made SmolLM2-135M's prefill 5.3x and its sampling 3.9x slower than float32.

An explicit dtype is kept, but one the device cannot compute is refused when the config loads (engine/config/schema.py):
float16 on a CPU without native half-precision arithmetic (x86 ``avx512_fp16`` or ``amx_fp16``, Arm ``fphp`` or
``asimdhp``), bfloat16 on a GPU without native bf16.

``ALIGNOPSD_CPU_FLAGS`` (space-separated flags; empty for none), when set, replaces the CPU's own flags: a run made
on a machine with native bf16 can be reproduced in float32 on one with it, and the test suite runs every ``auto``
model in float32 whatever CPU it is on. Nothing else reads the flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

CPU_FLAGS_ENV = "ALIGNOPSD_CPU_FLAGS"
CPUINFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (flags), x86 AMX, Arm (Features)
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16", "fphp", "asimdhp")  # x86 AVX-512 FP16 / AMX-FP16, Arm FP16 arithmetic
_NAMES = {
    "auto": None,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor listed in a ``/proc/cpuinfo`` text (x86 ``flags``, Arm
    ``Features``); empty when there is no such line."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags: ``$ALIGNOPSD_CPU_FLAGS`` when set, else ``/proc/cpuinfo``'s (empty where it
    cannot be read, e.g. off Linux: then ``auto`` is float32)."""
    forced = os.environ.get(CPU_FLAGS_ENV)
    if forced is not None:
        return frozenset(forced.split())
    try:
        return parse_cpu_flags(CPUINFO.read_text(errors="replace"))
    except OSError:
        return frozenset()


def cuda_native_bf16() -> bool:
    """Whether the current CUDA device computes bf16 natively (not by emulation)."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch without the emulation switch
        return bool(torch.cuda.is_bf16_supported())


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved parameter dtype and why it was chosen."""

    asked: str
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def line(self, what: str = "model.dtype") -> str:
        """One line for the run's log, e.g. ``model.dtype auto -> float32 (CPU without avx512_bf16/amx_bf16)``."""
        return f"{what} {self.asked} -> {self.name} ({self.reason})"


def _has(flags: frozenset[str], wanted: tuple[str, ...]) -> list[str]:
    return [f for f in wanted if f in flags]


def choose_dtype(
    asked: str | torch.dtype | None,
    device: torch.device | str = "cpu",
    *,
    flags: frozenset[str] | None = None,
    cuda_bf16: bool | None = None,
) -> DtypeChoice:
    """Resolve a dtype name (``auto`` / None by the hardware, see the module doc) on ``device``.

    ``flags`` (the CPU's) and ``cuda_bf16`` default to this machine's; tests pass them in. An explicit dtype is
    returned as it is (the config refuses one the device cannot compute when it loads: :func:`check_runs`)."""
    if isinstance(asked, torch.dtype):
        return DtypeChoice(str(asked).removeprefix("torch."), asked, "explicit")
    key = "auto" if asked is None else str(asked).lower()
    explicit = dtype_by_name(key)
    dev = torch.device(device)
    if explicit is not None:
        return DtypeChoice(key, explicit, "explicit" + _slow_note(explicit, dev, flags))
    if dev.type == "cuda":
        native = cuda_native_bf16() if cuda_bf16 is None else cuda_bf16
        return DtypeChoice(
            "auto", torch.bfloat16 if native else torch.float32, f"CUDA {'with' if native else 'without'} native bf16"
        )
    if dev.type != "cpu":
        return DtypeChoice("auto", torch.float32, f"{dev.type} device")
    flags = cpu_flags() if flags is None else flags
    found = _has(flags, BF16_CPU_FLAGS)
    if found:
        return DtypeChoice("auto", torch.bfloat16, f"CPU with {'/'.join(found)}")
    return DtypeChoice("auto", torch.float32, "CPU without avx512_bf16/amx_bf16 or Arm bf16")


def _slow_note(dtype: torch.dtype, dev: torch.device, flags: frozenset[str] | None) -> str:
    if dtype is not torch.bfloat16 or dev.type != "cpu":
        return ""
    flags = cpu_flags() if flags is None else flags
    if _has(flags, BF16_CPU_FLAGS):
        return ""
    return "; this CPU has no native bf16, so PyTorch emulates it: expect it several times slower than float32"


def check_runs(
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    flags: frozenset[str] | None = None,
    cuda_bf16: bool | None = None,
) -> None:
    """ValueError when ``device`` cannot compute ``dtype`` natively and PyTorch would not run it usefully there:
    float16 on a CPU without half-precision arithmetic, bfloat16 on a GPU without native bf16."""
    dev = torch.device(device)
    if dtype is torch.float16 and dev.type == "cpu":
        flags = cpu_flags() if flags is None else flags
        if not _has(flags, FP16_CPU_FLAGS):
            raise ValueError(
                "float16 needs a CPU with native half-precision arithmetic (x86 avx512_fp16 or amx_fp16, Arm "
                "fphp/asimdhp) and this one has none; use 'auto' (bfloat16 where the CPU has native bf16, else "
                "float32) or 'float32'"
            )
    if dtype is torch.bfloat16 and dev.type == "cuda":
        native = cuda_native_bf16() if cuda_bf16 is None else cuda_bf16
        if not native:
            raise ValueError(
                "bfloat16 needs a GPU with native bf16 (compute capability 8.0 or newer) and this one has none; "
                "use 'auto' (float32 here), 'float16' or 'float32'"
            )


def device_type(kind: str) -> str:
    """The device type a ``trainer.device`` value runs on: ``auto`` is CUDA where it is available, else the CPU."""
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def dtype_by_name(name: str) -> torch.dtype | None:
    """The torch dtype of a dtype name (None for ``auto``); ValueError for an unknown name."""
    if name.lower() not in _NAMES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(_NAMES)}, got {name!r}")
    return _NAMES[name.lower()]


def check_device_dtype(name: str, device: str) -> None:
    """:func:`check_runs` for a config's dtype name on its ``trainer.device`` (``auto`` always fits); the message
    starts with the device: "this machine's CPU: float16 needs ..."."""
    dtype = dtype_by_name(name)
    if dtype is None:
        return
    kind = device_type(device)
    try:
        check_runs(dtype, kind)
    except ValueError as exc:
        raise ValueError(f"this machine's {kind.upper()}: {exc}") from None


def int8_sampling(quantize: str, device: str, dtype: torch.dtype) -> bool:
    """Whether ``generation.quantize`` has the Hugging Face generator sample from an int8 copy of a policy that computes
    in ``dtype`` on ``device`` (a device type): ``int8``, or ``auto`` where that is float32 on the CPU (a CPU without
    native bf16, see the module doc). The one answer, asked where the generator is built and where the config is
    checked (``trainer.ppo.logprob_reuse`` needs a generator that samples from the policy itself)."""
    if quantize == "auto":
        return device == "cpu" and dtype is torch.float32
    return quantize == "int8"
