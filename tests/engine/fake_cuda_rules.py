"""The device rules of the fake CUDA device (fake_cuda.py, beside this file) that need none of its tensors: which ops
take a 0-dim CPU tensor beside CUDA ones, device arguments and ordinals, and the fake CUDA generator."""

from __future__ import annotations

import functools
from typing import Any

import torch

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)

# Python names whose aten op is named otherwise; TensorIterator ops without the ``pointwise`` tag, and ops that
# read a 0-dim value tensor on the host (fill_, masked_fill_, index_fill_, index_put_ and so ``cuda[idx] = cpu_0d``)
_ATEN_NAME = {
    "truediv": "div",
    "floordiv": "floor_divide",
    "mod": "remainder",
    "and": "bitwise_and",
    "or": "bitwise_or",
    "xor": "bitwise_xor",
    "lshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift",
}
_CPU_SCALARS_TOO = {"floor_divide", "fill", "masked_fill", "index_fill", "index_put", "setitem"}


def is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # an int device is a CUDA ordinal, as in torch
    return torch.device(device).type == "cuda"


def check_ordinal(device: Any) -> None:
    index = device if isinstance(device, int) else torch.device(device).index
    if index not in (None, 0):
        raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index}; one fake device is visible)")


def _pointwise(name: str) -> bool:
    packet = getattr(aten, name, None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


@functools.cache
def takes_cpu_scalars(name: str) -> bool:
    """Whether the op called ``name`` (a torch function, tensor method or operator such as ``__radd__``) accepts a
    0-dim CPU tensor beside CUDA tensors: the TensorIterator kernels (elementwise: aten ops tagged ``pointwise``)
    and the ops that read a 0-dim value tensor with ``.item()``. Everything else (``stack``, ``cat``,
    ``index_select``, ``gather``, matmul, ...) checks devices strictly."""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name not in _ATEN_NAME and not _pointwise(name) and name[:1] in ("r", "i"):  # __radd__, __iadd__
            name = name[1:]
        name = _ATEN_NAME.get(name, name)
    base = name.rstrip("_")  # in-place forms
    return base in _CPU_SCALARS_TOO or _pointwise(name) or _pointwise(base)


class FakeCudaGenerator(torch._C.Generator):
    """``torch.Generator("cuda")`` under the mode: a CPU generator (it drives the CPU payloads' draws) whose
    ``device`` is ``cuda:0``, so that a draw can be checked against the device it draws on."""

    def __new__(cls, device: Any = "cuda") -> FakeCudaGenerator:  # noqa: ARG004 - torch.Generator's signature
        return super().__new__(cls, "cpu")

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA


class GeneratorMeta(type):
    """``torch.Generator`` under the mode: ``device="cuda"`` gives a :class:`FakeCudaGenerator`; isinstance still
    works."""

    def __call__(cls, device: Any = "cpu"):
        if is_cuda_device(device):
            check_ordinal(device)
            return FakeCudaGenerator()
        return torch._C.Generator(device)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch._C.Generator)


class Generator(metaclass=GeneratorMeta):
    """What ``torch.Generator`` is under the mode (see :class:`GeneratorMeta`)."""
