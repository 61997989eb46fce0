"""The kernels' one routing rule, and the launch of their Triton kernels.

Routing: :func:`resolve_impl` decides, for one call, which implementation runs: ``"triton"`` (the Triton kernel),
``"torch"`` (the torch path) or ``"cpp"`` (a custom CPU path: a C++ kernel of ``alignopsd._C``, or the BLAS entry of
the LM head's bf16 GEMM), from the ``impl`` asked for (``"auto" | "triton" | "torch" | "cpp"``), the device of the
operands, and, for a call that has a custom CPU path (:class:`NativePath`), whether that path applies to these
operands (dtype, device, shape, this process) and the measured choice between it and the torch path
(``native_choice.py``). ``"auto"`` picks Triton on CUDA, else the custom CPU path where it applies and was measured
faster, else the torch path; a forced value is checked (ValueError naming ``impl``). Every kernel entry asks it;
so does the algorithm core (:func:`core_uses_kernels`, ``core=True``), the method's C++ paths
(``alignopsd._native``) and the decoding cache's prefill attention. Triton kernels on CPU tensors run only under
the Triton interpreter (``TRITON_INTERPRET=1``), which is how the tests exercise them without a GPU.

The routing state (:data:`ROUTING`) lives here; the switches that change it for tests and checks
(``force_kernels``, ``torch_paths_only``, ``launches_on_host``) are public in ``alignopsd.testing``, not in the
kernels' own exports. ``force_kernels`` extends the core's routing to CPU tensors under the Triton interpreter, so
tests can prove the routing, and its answers, without a GPU.

Launch: kernels are written as plain Python functions and turned into Triton kernels lazily by :func:`jit`, at
first launch, not at import. ``triton.jit`` decides between the compiler and the interpreter when it decorates a
function, so decorating at launch time makes the choice follow ``TRITON_INTERPRET`` as it is when the kernel is
used, whichever module imported triton first. The same holds for triton's own library functions (``tl.zeros``,
``tl.sum``, ``tl.max`` are ``@jit`` functions of ``triton.language.standard``, fixed when triton is imported):
:func:`launch` swaps interpreted twins in for the duration of an interpreted launch and restores the originals
afterwards, so nothing outside the call changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from alignopsd.kernels.native_choice import KernelChoice, recorded

try:  # triton is optional: the torch paths work without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001  (ImportError, or a broken install without a driver)
    triton = None
    tl = None
    HAS_TRITON = False

IMPLS = ("auto", "triton", "torch", "cpp")

_JIT_CACHE: dict[tuple[Callable, bool], Any] = {}


# (kernel function, its positional arguments, its keyword arguments) -> None when served, else (args, kwargs)
HostLaunch = Callable[[Callable, tuple, dict], tuple[tuple, dict] | None]


@dataclass
class Routing:
    """The routing state of the process, changed only by ``alignopsd.testing``'s switches (each nests)."""

    forced: int = 0  # force_kernels(): the core treats CPU tensors as kernel devices (Triton interpreter)
    torch_only: int = 0  # torch_paths_only(): "auto" never picks Triton, not even for CUDA tensors
    host_launch: list[HostLaunch] = field(default_factory=list)  # launches_on_host(): the host serves launches


ROUTING = Routing()


def interpret_mode() -> bool:
    """Whether the Triton interpreter is requested (``TRITON_INTERPRET`` set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class NativePath:
    """The custom CPU path a call could take instead of its torch path (a C++ kernel, or the head's bf16 GEMM).

    applies: it can run on these operands in this process. choice: the name of its measured choice
    (``native_choice.HEAD``, ``HEAD_GEMM``, ``ATTENTION``): ``"auto"`` takes the path only where that choice says
    it is faster, measured by ``measure`` (on the call's operands) when nothing was recorded yet; None: taken
    wherever it applies (the method's C++ segmentation and projection, bit-identical to their Python paths).
    why: why it cannot run here, the error of a forced ``impl="cpp"``.
    """

    applies: bool
    choice: str | None = None
    measure: Callable[[], KernelChoice] | None = None
    why: str = ""

    def __post_init__(self) -> None:
        if self.choice is not None and self.measure is None:
            raise ValueError(f"measure: the measured choice {self.choice!r} needs a way to measure it")

    def chosen(self) -> bool:
        """Whether ``"auto"`` takes it: it applies and, for a measured choice, the recorded (else now measured)
        choice says it is faster."""
        if not self.applies:
            return False
        if self.choice is None:
            return True
        c = recorded(self.choice)
        return (c if c is not None else self.measure()).native


def resolve_impl(impl: str, *tensors: torch.Tensor | None, native: NativePath | None = None, core: bool = False) -> str:
    """``"triton"``, ``"torch"`` or ``"cpp"``: what runs for a call asking for ``impl`` on ``tensors``.

    tensors: the operands whose device picks Triton (any on CUDA); a path without a Triton kernel passes none.
    native: the call's custom CPU path, if it has one (:class:`NativePath`). core: the algorithm core asks
    (:func:`core_uses_kernels`): under ``alignopsd.testing.force_kernels`` CPU tensors go to Triton too.
    ``"auto"``: Triton where a tensor is on CUDA and triton is importable (never inside
    ``alignopsd.testing.torch_paths_only``), else the custom CPU path where :meth:`NativePath.chosen`, else torch.
    Raises ValueError for an unknown ``impl``, a forced ``"triton"`` that cannot run, or a forced ``"cpp"`` without
    a custom CPU path that applies.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl: unknown value {impl!r}; allowed: {', '.join(map(repr, IMPLS))}")
    on_cuda = any(t.is_cuda for t in tensors if t is not None)
    if impl == "triton":
        if not HAS_TRITON:
            raise ValueError("impl: 'triton' requested but triton is not importable; use impl='torch'")
        if not on_cuda and not interpret_mode():
            raise ValueError(
                "impl: 'triton' on CPU tensors needs the Triton interpreter; set TRITON_INTERPRET=1 "
                "in the environment (before launching) or use impl='torch'"
            )
        return "triton"
    if impl == "cpp":
        if native is None:
            raise ValueError("impl: 'cpp' requested but this call has no C++ path; use impl='auto' or 'torch'")
        if not native.applies:
            raise ValueError(f"impl: 'cpp' requested but it cannot run here: {native.why or 'it does not apply'}")
        return "cpp"
    if impl == "torch":
        return "torch"
    kernel_device = on_cuda or (core and ROUTING.forced > 0)
    if HAS_TRITON and ROUTING.torch_only == 0 and kernel_device:
        return "triton"
    return "cpp" if native is not None and native.chosen() else "torch"


def core_uses_kernels(*tensors: torch.Tensor | None) -> bool:
    """Whether the algorithm core runs on the Triton kernels for these tensors (it then calls the kernel entries
    with ``impl="triton"``): :func:`resolve_impl` of ``"auto"`` for the core. True when triton is importable and
    some tensor is on CUDA, or inside ``alignopsd.testing.force_kernels``."""
    return resolve_impl("auto", *tensors, core=True) == "triton"


def jit(fn: Callable) -> Any:
    """``triton.jit(fn)``, decorated now (compiler or interpreter per the current environment) and cached."""
    if not HAS_TRITON:
        raise ValueError("impl: triton is not importable")
    key = (fn, interpret_mode())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        kernel = triton.jit(fn)
        _JIT_CACHE[key] = kernel
    return kernel


def upcast_dots(t: torch.Tensor) -> bool:
    """Whether kernels must cast operands to fp32 before ``tl.dot`` (the interpreter has no bf16 dot)."""
    return interpret_mode() or not t.is_cuda


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 ("ieee") for fp32 operands, like torch's default matmul."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device}, got {t.device}")


_STDLIB_TWINS: dict[int, Any] = {}


@contextmanager
def _interpreter_stdlib() -> Iterator[None]:
    """Within an interpreted launch, make triton's ``@jit`` library functions interpretable."""
    if not interpret_mode():
        yield
        return
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = []
    for mod in (tl, std, tl.math):
        for name, val in list(vars(mod).items()):
            if isinstance(val, JITFunction) and not isinstance(val, InterpretedFunction):
                twin = _STDLIB_TWINS.get(id(val))
                if twin is None:
                    twin = _STDLIB_TWINS[id(val)] = InterpretedFunction(val.fn)
                saved.append((mod, name, val))
                setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, val in saved:
            setattr(mod, name, val)


def launch(fn: Callable, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch kernel ``fn`` (a plain function, see :func:`jit`) on ``grid``; where the host serves launches
    (:attr:`Routing.host_launch`), the innermost server first: it runs the launch itself, or hands back the
    arguments the Triton interpreter launches with."""
    if ROUTING.host_launch:
        served = ROUTING.host_launch[-1](fn, args, kwargs)
        if served is None:
            return
        args, kwargs = served
    kernel = jit(fn)
    with _interpreter_stdlib():
        kernel[grid](*args, **kwargs)
