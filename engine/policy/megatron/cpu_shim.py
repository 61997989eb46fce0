"""Run megatron-core without CUDA.

megatron-core assumes CUDA in a few places: ``torch.cuda.current_device()`` as the device of
new buffers (RoPE frequencies, gathered activations), the CUDA RNG state of its model-parallel
RNG tracker, ``torch.cuda.manual_seed``, the default causal mask and small tensors of the
optimizer, its loss scaler and DDP grad buffers made with ``device="cuda"``, a ``torch.cuda.FloatTensor``
assertion in gradient clipping, and the CUDA type names by which the mixed-precision optimizer
(bf16/fp16 parameters, fp32 main copies) sorts its parameters. On a machine without CUDA this
module redirects exactly those calls to the CPU so that the same backend code runs under gloo
(tests, CI, laptops). It is only ever applied by the Megatron backend, and only when CUDA is
absent; with CUDA it does nothing.
Nothing outside this backend touches ``torch.cuda``.
"""

from __future__ import annotations

import torch

_APPLIED = False


def _cpu_if_cuda(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and (str(dev).startswith("cuda") or isinstance(dev, int)):
        kwargs["device"] = "cpu"
    return kwargs


class _CpuTorch:
    """A stand-in for the ``torch`` module inside a few megatron-core modules: tensor
    factories asked for ``device="cuda"`` get the CPU; everything else is torch itself."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        attr = getattr(self._real, name)
        if name in self._FACTORIES:

            def factory(*args, **kwargs):
                return attr(*args, **_cpu_if_cuda(kwargs))

            return factory
        return attr


def _cpu_device(*_args, **_kwargs) -> torch.device:
    return torch.device("cpu")


def _get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # The tracker seeds "the CUDA generator" with a model-parallel offset; on CPU the only
    # generator is the default one, and the tracker restores it after each fork.
    torch.manual_seed(seed)


def _with_cuda_type_names(init):
    """Run ``init`` while CPU tensors report CUDA type names ("torch.BFloat16Tensor" -> "torch.cuda.BFloat16Tensor").

    megatron-core's mixed-precision optimizer (bf16/fp16 parameters with fp32 main copies) sorts its
    parameters by ``param.type()`` and rejects anything that is not a CUDA type; the rest of it works on CPU.
    """

    def wrapped(self, *args, **kwargs):
        real = torch.Tensor.type

        def cuda_named(t, *a, **k):
            name = real(t, *a, **k)
            if a or k or not name.startswith("torch.") or name.startswith("torch.cuda."):
                return name
            return "torch.cuda." + name[len("torch.") :]

        torch.Tensor.type = cuda_named  # type: ignore[method-assign]
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real  # type: ignore[method-assign]

    return wrapped


def apply_if_needed() -> bool:
    """Patch the CUDA-only calls when CUDA is absent. Idempotent. Returns whether patched."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    torch.cuda.get_rng_state = _get_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _set_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = _manual_seed  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = _get_rng_state  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state

    import megatron.core.fusions.fused_softmax as fsoftmax
    import megatron.core.transformer.utils as mutils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    mutils.get_default_causal_mask = causal_mask
    fsoftmax.get_default_causal_mask = causal_mask

    # The optimizer wrappers and the DDP grad buffers create small tensors on "cuda".
    import megatron.core.distributed.distributed_data_parallel as mddp
    import megatron.core.distributed.param_and_grad_buffer as mbuf
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.grad_scaler as mscaler
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.utils as mcutils

    for module in (mopt, mbuf, mddp, mclip, mcutils, mscaler):
        module.torch = _CpuTorch(torch)

    # clip_grad_by_total_norm_fp32 asserts that grads are torch.cuda.FloatTensor.
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff >= 1.0:
            return
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is not None:
                grad.detach().mul_(clip_coeff)

    mclip.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    f16 = mopt.Float16OptimizerWithFloat16Params
    f16.__init__ = _with_cuda_type_names(f16.__init__)
    _APPLIED = True
    return True
