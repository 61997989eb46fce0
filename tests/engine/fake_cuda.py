"""A strict fake CUDA device for the test suite: the whole engine runs on the CPU as if ``cuda:0`` existed.

Inside ``with FakeCuda() as fc:``

* tensors placed on "cuda" (``.to("cuda")``, ``.cuda()``, factories with ``device="cuda"``, ``Module.to``) are
  :class:`FakeCudaTensor`: a ``__torch_dispatch__`` wrapper whose ``device`` is ``cuda:0`` (``is_cuda`` is true)
  and whose payload is a CPU tensor. Every aten op on them unwraps, runs on the payload and wraps the result, and
  every op first checks its tensor arguments the way the CUDA backend does: a CUDA tensor beside a CPU tensor
  raises ``RuntimeError("Expected all tensors to be on the same device ...")``, except a 0-dim CPU tensor given
  to an elementwise op (TensorIterator's CPU scalars: ops tagged ``pointwise`` and the few that read a 0-dim
  value with ``.item()``, :func:`takes_cpu_scalars`), CPU index tensors of ``cuda[idx]`` and copies across
  devices (``copy_``, ``cuda[a:b] = cpu``). The check comes from the ops themselves, so no call site has to be
  listed; test_fake_cuda.py (beside this file) tables each rule with the torch source it follows.
* host synchronisations are counted: ``.item()`` (and ``float()``/``bool()``/``int()`` of a tensor), ``.tolist()``,
  copies to the host (``.cpu()``, ``.to("cpu")``, ``cpu.copy_(cuda)``), ops whose output size depends on the data
  (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) and ``torch.cuda.synchronize``. Counts are
  kept per kind and per profiler phase (:func:`alignopsd.engine.observe.profiler.current_phase`); ``.numpy()`` of a CUDA
  tensor raises, as on a GPU. ``torch.cuda.set_sync_debug_mode`` works as on a GPU: in "warn" mode every host
  sync but ``torch.cuda.synchronize`` also warns "called a synchronizing CUDA operation" ("error": raises), which
  is what engine/observe/cuda_syncs.py counts on a real device.
* the ``torch.cuda`` calls the engine makes answer as one visible device would: ``is_available``, ``device_count``
  (1), ``current_device``/``set_device`` (0 only), ``synchronize``, ``empty_cache``, memory statistics (the
  payload bytes alive are not tracked: 0), ``get_device_properties``/``get_device_name``, ``is_bf16_supported``
  (true), RNG state get/set and seeding (a CPU generator stands for the device's). ``torch.Generator(device=
  "cuda")`` gives a :class:`FakeCudaGenerator` (a CPU generator whose ``device`` is ``cuda:0``); a draw checks
  its generator against the device it draws on, as CUDA does (a CPU generator for a CUDA draw raises, and the
  reverse).
* Triton (when importable): the engine takes the branches it takes on a GPU (``impl="auto"`` and the core's kernel
  routing pick the Triton kernels for the fake CUDA tensors), so the code around each launch (output allocation,
  grids, the fused log-prob's and the sibling top-K's host logic) runs under the device checks; the launch itself
  is served on the CPU tensors behind the fake ones (``alignopsd.testing.launches_on_host``), writing the memory
  the caller sees: by the Triton interpreter (``TRITON_INTERPRET=1`` for the mode's duration; the sibling top-K
  and JSD kernels), or by the kernel's declared launch reference where the interpreter is too slow for a
  vocabulary (the fused log-prob's forward and backward kernels: ~0.6 ms per tile, half a minute per 20 rows of
  a 49k vocabulary).
  ``FakeCuda(kernels=False)`` keeps the kernels' torch paths instead (``alignopsd.testing.torch_paths_only``).

The mode patches process-wide state (``torch.cuda`` functions, ``torch.Generator``) for its duration and is not
thread-safe. Its host-sync counts reach the step profiler as a real device's do: it registers with
``profiler.register_sync_counter`` while active (engine/observe/cuda_syncs.py is the real device's counter).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Any

import torch
from alignopsd.engine.observe import profiler
from alignopsd.kernels import HAS_TRITON
from fake_cuda_rules import (
    CUDA,
    FakeCudaGenerator,
    Generator,
    check_ordinal,
    is_cuda_device,
    takes_cpu_scalars,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from alignopsd.testing import launches_on_host, torch_paths_only

aten = torch.ops.aten
_ACTIVE: list[FakeCuda] = []

# ops whose output size depends on the data: the host waits for the device to know it
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _note_sync(kind: str) -> None:
    for fc in _ACTIVE:
        fc.note_sync(kind)
    mode = _ACTIVE[-1].sync_debug_mode if _ACTIVE else 0
    if mode and kind != "synchronize":  # torch.cuda.set_sync_debug_mode: warn (1) or error (2) at a host sync
        if mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=3)


class FakeCudaTensor(torch.Tensor):
    """A tensor on the fake ``cuda:0``: CPU memory, CUDA identity (see the module docstring).

    The tensor itself is a CPU tensor (so autograd, optimisers and the CPU kernels run it unchanged); Python sees
    ``device == cuda:0`` and ``is_cuda``, and every torch call with it passes :func:`_check_devices` first;
    every aten op on it wraps its outputs as fake CUDA tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return 0

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 - torch's signature
        return f"FakeCudaTensor({plain(self)!r}, device='cuda:0')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT or (func in _INDEX_OPS and _bool_index(args)):
            _note_sync("data_dependent")
        elif func is aten._local_scalar_dense.default:
            _note_sync("item")
        elif func is aten.copy_.default and not isinstance(args[0], FakeCudaTensor):
            _note_sync("to_host")
        with torch._C._DisableTorchDispatch():
            out = func(*args, **kwargs)
            if func is aten.copy_.default and not isinstance(args[0], FakeCudaTensor):
                return out  # a copy into host memory stays on the host
            return tree_map_only(torch.Tensor, _as_fake, out)


def _as_fake(t: torch.Tensor) -> FakeCudaTensor:
    """``t`` (a CPU tensor) as a fake CUDA tensor sharing its memory (itself when it already is one)."""
    if isinstance(t, FakeCudaTensor):
        return t
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return t.as_subclass(FakeCudaTensor)


def plain(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor behind a fake CUDA tensor (sharing its memory; no sync is counted)."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return t.as_subclass(torch.Tensor)


def _payload(arg: Any) -> Any:
    """A kernel launch's argument as the Triton interpreter takes it: the CPU tensor behind a fake CUDA one."""
    return plain(arg) if isinstance(arg, FakeCudaTensor) else arg


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


# cross-device by definition, or metadata only (moves are handled apart)
_NO_CHECK = {torch.Tensor.copy_, torch.Tensor.type_as, torch._has_compatible_shallow_copy_type, torch.is_same_size}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}


def _check_devices(func, args: tuple, kwargs: dict) -> None:
    """Raise as the CUDA backend does when ``func`` mixes a fake CUDA tensor with a CPU tensor (a 0-dim one only
    beside an op that :func:`takes_cpu_scalars`), or draws with a generator of the other device.

    Checked where a call enters torch (every torch function and tensor method), so internal tensors that torch's
    own composite kernels make on the CPU are not mistaken for the caller's. ``cuda[cpu_index]`` is allowed (CUDA
    moves the index); ``cpu[cuda_index]`` is not; ``x[a:b] = y`` (no index tensor) is a copy, across devices too."""
    if func in _NO_CHECK:
        return
    if func in _INDEXING and len(args) > 1:
        index = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
        if not isinstance(args[0], FakeCudaTensor) and args[0].dim() > 0 and any(_fake(t) for t in index):
            raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        if func is torch.Tensor.__setitem__ and not index:
            return  # basic indexing: the value is copied into a view (copy_ crosses devices)
        args = (args[0], *args[2:])
    leaves = tree_flatten((args, kwargs))[0]
    flat = [t for t in leaves if isinstance(t, torch.Tensor)]
    gens = [g for g in leaves if isinstance(g, torch._C.Generator)]
    if gens:
        _check_generators(gens, kwargs.get("device"), flat)
    if len(flat) < 2 or not any(_fake(t) for t in flat):
        return
    name = getattr(func, "__name__", None) or str(func)
    for t in flat:
        if not _fake(t) and t.device.type == "cpu" and (t.dim() > 0 or not takes_cpu_scalars(name)):
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                f"(in {name}: a CPU tensor of shape {tuple(t.shape)} beside a CUDA tensor)"
            )


def _fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeCudaTensor)


def _check_generators(gens: list, device: Any, tensors: list) -> None:
    """A draw's generator must be on the device it draws on (``check_generator`` of aten/src/ATen/core/
    Generator.h: "Expected a 'cuda' device type for generator but found 'cpu'"). The draw's device: the
    factory's ``device`` argument, else that of its tensors."""
    on_cuda = is_cuda_device(device) if device is not None else any(_fake(t) for t in tensors)
    want = "cuda" if on_cuda else "cpu"
    for g in gens:
        got = "cuda" if isinstance(g, FakeCudaGenerator) else g.device.type
        if got != want:
            raise RuntimeError(f"Expected a '{want}' device type for generator but found '{got}'")


class _HostToDevice(torch.autograd.Function):
    """A CPU tensor copied to the fake device (differentiable, like ``.to("cuda")``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> FakeCudaTensor:  # noqa: ARG004
        return _as_fake(plain(x).clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return plain(grad).clone()


class _DeviceToHost(torch.autograd.Function):
    """A fake CUDA tensor copied to the host (differentiable, like ``.cpu()``); a host synchronisation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        _note_sync("to_host")
        return plain(x).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return _as_fake(grad.clone())


def to_fake(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied to the fake ``cuda:0`` (itself when it is already there)."""
    if isinstance(x, FakeCudaTensor):
        return x
    if x.device.type != "cpu":
        raise RuntimeError(f"to_fake: expected a CPU tensor, got one on {x.device}")
    if x.requires_grad:
        return _HostToDevice.apply(x)
    return _as_fake(x.detach().clone())


def to_host(x: FakeCudaTensor) -> torch.Tensor:
    """A fake CUDA tensor copied to the host (a counted synchronisation)."""
    if x.requires_grad:
        return _DeviceToHost.apply(x)
    _note_sync("to_host")
    return plain(x).detach().clone()


_NEW_METHODS = {
    torch.Tensor.new_tensor,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_empty,
    torch.Tensor.new_full,
}


class _FunctionMode(TorchFunctionMode):
    """Device moves, factories with ``device="cuda"`` and the tensor methods that read memory directly."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._to(func, args, kwargs)
        _check_devices(func, args, kwargs)
        self_t = args[0] if args else None
        if isinstance(self_t, FakeCudaTensor):
            if func is torch.Tensor.tolist:
                _note_sync("tolist")
                return plain(self_t).tolist()
            if func in (torch.Tensor.numpy, torch.Tensor.__array__):
                raise TypeError(
                    "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                    "host memory first."
                )
            if func in _NEW_METHODS:
                device = kwargs.pop("device", None)
                out = func(plain(self_t), *args[1:], **kwargs)
                return out.to(device) if device is not None and not is_cuda_device(device) else to_fake(out)
        if is_cuda_device(kwargs.get("device")) and func not in _NEW_METHODS:
            check_ordinal(kwargs["device"])
            kwargs["device"] = "cpu"
            grad = kwargs.pop("requires_grad", False)
            out = func(*args, **kwargs)
            fresh = func not in (torch.as_tensor, torch.asarray)  # these may alias their input
            res = _as_fake(out if fresh else out.clone())
            return res.requires_grad_(True) if grad else res
        return func(*args, **kwargs)

    @staticmethod
    def _to(func, args: tuple, kwargs: dict) -> torch.Tensor:
        x, rest = args[0], args[1:]
        dtype, copy = None, False
        if func is torch.Tensor.cpu:
            device = "cpu"
        elif func is torch.Tensor.cuda:
            device = rest[0] if rest else kwargs.get("device", 0)
            device = CUDA if device is None else device
        elif rest and isinstance(rest[0], torch.Tensor):  # x.to(other): other's device and dtype
            device, dtype = rest[0].device, rest[0].dtype
        else:
            parse_kw = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to does not take ``copy``
            device, dtype, _, _ = torch._C._nn._parse_to(*rest, **parse_kw)
            copy = bool(kwargs.get("copy", False))
        if device is None:
            return func(*args, **kwargs)
        if is_cuda_device(device):
            check_ordinal(device)
            if isinstance(x, FakeCudaTensor):
                return x.to(dtype=dtype, copy=copy) if (dtype is not None or copy) else x
            return to_fake(x.to(dtype=dtype) if dtype is not None else x)
        if isinstance(x, FakeCudaTensor):
            host = to_host(x)
            return host.to(dtype=dtype) if dtype is not None else host
        return func(*args, **kwargs)


class _DispatchMode(TorchDispatchMode):
    """aten ops asked for a CUDA device (factories, ``_to_copy``) below the Python API: inside a Python-level torch
    function that the function mode let through (an autograd backward, a functional's body), CUDA factories reach
    the dispatcher directly. They run on the CPU and come back as fake CUDA tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_cuda_device(kwargs.get("device")):
            check_ordinal(kwargs["device"])
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return tree_map_only(torch.Tensor, _as_fake, out)
        return func(*args, **kwargs)


class _Props:
    name = "FakeCuda (CPU payload)"
    major, minor = 9, 0
    multi_processor_count = 1
    total_memory = 80 * 2**30


class FakeCuda(profiler.SyncCounts):
    """The fake-CUDA context (see the module docstring). ``syncs``: Counter of (phase, kind) -> host syncs, booked
    per profiler phase as a real device's counter books them (``profiler.SyncCounts``)."""

    def __init__(self, kernels: bool = True) -> None:
        super().__init__()
        self.kernels = kernels and HAS_TRITON  # launches served by the Triton interpreter, else the torch paths
        self.launches: Counter = Counter()  # kernel name -> launches served on the host
        self._saved: list[tuple[Any, str, Any]] = []
        self._modes: list[Any] = []
        self._rng = torch.Generator("cpu")
        self._rng.manual_seed(0)
        self.sync_debug_mode = 0  # torch.cuda.set_sync_debug_mode: 0 default, 1 warn, 2 error

    def note_launch(self, kernel: str) -> None:
        self.launches[kernel] += 1

    # ------------------------------------------------------------------ torch.cuda
    def _cuda_api(self) -> dict[str, Any]:
        def set_device(device: Any) -> None:
            check_ordinal(device)

        def synchronize(device: Any = None) -> None:  # noqa: ARG001
            _note_sync("synchronize")

        def get_rng_state(device: Any = "cuda") -> torch.Tensor:  # noqa: ARG001
            return self._rng.get_state()

        def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:  # noqa: ARG001
            self._rng.set_state(state.cpu() if isinstance(state, FakeCudaTensor) else state)

        def set_rng_state_all(states: list) -> None:
            if len(states) > 1:
                raise RuntimeError(f"set_rng_state_all: {len(states)} states for 1 visible device")
            for s in states:
                set_rng_state(s)

        def set_sync_debug_mode(mode: int | str) -> None:
            names = {"default": 0, "warn": 1, "error": 2}
            if mode not in (0, 1, 2) and mode not in names:
                raise RuntimeError(f"invalid value of debug_mode, expected one of default, warn, error: {mode!r}")
            self.sync_debug_mode = names.get(mode, mode)

        zero = lambda *a, **k: 0  # noqa: E731
        return {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": set_device,
            "synchronize": synchronize,
            "empty_cache": lambda: None,
            "memory_allocated": zero,
            "max_memory_allocated": zero,
            "memory_reserved": zero,
            "max_memory_reserved": zero,
            "reset_peak_memory_stats": lambda *a, **k: None,
            "mem_get_info": lambda *a, **k: (_Props.total_memory, _Props.total_memory),
            "get_device_properties": lambda *a, **k: _Props(),
            "get_device_name": lambda *a, **k: _Props.name,
            "get_device_capability": lambda *a, **k: (_Props.major, _Props.minor),
            "is_bf16_supported": lambda *a, **k: True,
            "get_rng_state": get_rng_state,
            "set_rng_state": set_rng_state,
            "get_rng_state_all": lambda: [get_rng_state()],
            "set_rng_state_all": set_rng_state_all,
            "manual_seed": lambda seed: self._rng.manual_seed(int(seed)) and None,
            "manual_seed_all": lambda seed: self._rng.manual_seed(int(seed)) and None,
            "seed": lambda: self._rng.seed() and None,
            "set_sync_debug_mode": set_sync_debug_mode,
            "get_sync_debug_mode": lambda: self.sync_debug_mode,
        }

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self) -> FakeCuda:
        for name, fn in self._cuda_api().items():
            self._patch(torch.cuda, name, fn)
        for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
            self._patch(torch.cuda.random, name, getattr(torch.cuda, name))
        self._patch(torch, "Generator", Generator)
        # Module.to: new Parameter objects around the fake tensors (``param.data = fake`` would keep a CPU impl)
        self._overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        if self.kernels:
            self._interpret = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
        self._paths = launches_on_host(_payload, self.note_launch) if self.kernels else torch_paths_only()
        self._paths.__enter__()
        self._modes = [_FunctionMode(), _DispatchMode()]
        for m in self._modes:
            m.__enter__()
        _ACTIVE.append(self)
        profiler.register_sync_counter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        profiler.unregister_sync_counter(self)
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._paths.__exit__(*exc)
        if self.kernels:
            if self._interpret is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = self._interpret
        torch.__future__.set_overwrite_module_params_on_conversion(self._overwrite)
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()
