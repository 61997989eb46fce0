"""The fused element-wise work of a Llama/Qwen2/Qwen3 model's layers (``alignopsd.kernels.fused_ops``), swapped into
the Hugging Face modules where a trial measured it faster.

:func:`install` routes the architecture's ``RMSNorm`` and ``MLP`` forwards and its ``apply_rotary_pos_emb`` through
a choice made per call: the fused op where this process recorded it as faster (``native_choice``'s ``RMS_NORM``,
``SWIGLU``, ``ROTARY``) for the call's class (dtype and feature width: the hidden size of a norm, the MLP's width,
the head dim), on a CPU, in a forward that records a graph (the update, the warm start); the stock code everywhere
else (generation and scoring run without a graph, and a measured choice covers forward and backward together). It
patches the transformers classes once per process; a module never measured takes the stock path through it.

:func:`choose_fused_ops` is the trial: each op, forward and backward, at the quickstart's update micro-batch
(``PROBE_ROWS`` rows of ``PROBE_POSITIONS`` positions) in the model's dtype and widths, against the stock module's
own code on a copy of one of the model's modules, before the run's first step; its lines go to the run's first
lines with the head kernels' (engine/run/policy_builders.py), the compilation's seconds with them.
"""

from __future__ import annotations

import copy
import importlib

import torch
from alignopsd.kernels.fused_ops import compile_seconds, fwd_bwd, measure_op, rms_norm, rotary, swiglu
from alignopsd.kernels.native_choice import FUSED_OPS, RMS_NORM, ROTARY, SWIGLU, KernelChoice, pinned, recorded
from torch import Tensor, nn

ARCHITECTURES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}  # model_type -> transformers class prefix
SILU = ("silu", "swish")  # the MLP activations the fused SwiGLU computes
PROBE_ROWS, PROBE_POSITIONS = 8, 464  # the quickstart's update micro-batch

_STOCK: dict[str, dict] = {}  # model_type -> the transformers module, its classes and their stock code
_MEASURED: dict[str, tuple] = {}  # op -> the call class its choice was measured on (absent: a restored choice)


def _taken(op: str, key: tuple, *tensors: Tensor) -> bool:
    """Whether this call takes the fused ``op``: recorded faster for its class ``key``, on a CPU, with a graph."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors) or tensors[0].device.type != "cpu":
        return False
    choice = recorded(op)
    return choice is not None and choice.native and _MEASURED.get(op, key) == key


def _norm_forward(stock):
    def forward(self, hidden_states: Tensor) -> Tensor:
        key = (hidden_states.dtype, hidden_states.shape[-1])
        if _taken(RMS_NORM, key, hidden_states, self.weight):
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return stock(self, hidden_states)

    return forward


def _mlp_forward(stock):
    def forward(self, x: Tensor) -> Tensor:
        if self.config.hidden_act not in SILU or not torch.is_grad_enabled():
            return stock(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if _taken(SWIGLU, (gate.dtype, gate.shape[-1]), gate, up):
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(self.act_fn(gate) * up)

    return forward


def _rotary_function(stock):
    def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
        free = not (cos.requires_grad or sin.requires_grad)
        if free and _taken(ROTARY, (q.dtype, q.shape[-1]), q, k):
            return rotary(q, k, cos, sin, unsqueeze_dim)
        return stock(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def install(model: nn.Module) -> dict | None:
    """Route ``model``'s architecture through the per-call choice (once per process and architecture); returns its
    stock code (``module``, ``norm``/``mlp`` classes, ``norm_forward``, ``mlp_forward``, ``rotary``), or None for an
    architecture without fused ops (anything but Llama, Qwen2, Qwen3) or a model without a Hugging Face config."""
    model_type = model.config.model_type if model.config is not None else None
    if model_type not in ARCHITECTURES:
        return None
    if model_type not in _STOCK:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        prefix = ARCHITECTURES[model_type]
        norm, mlp = vars(module)[f"{prefix}RMSNorm"], vars(module)[f"{prefix}MLP"]
        stock = dict(module=module, norm=norm, mlp=mlp, norm_forward=norm.forward, mlp_forward=mlp.forward)
        stock["rotary"] = module.apply_rotary_pos_emb
        norm.forward = _norm_forward(stock["norm_forward"])
        mlp.forward = _mlp_forward(stock["mlp_forward"])
        module.apply_rotary_pos_emb = _rotary_function(stock["rotary"])
        _STOCK[model_type] = stock
    return _STOCK[model_type]


def _first(model: nn.Module, cls: type, width: int | None = None) -> nn.Module:
    for m in model.modules():
        if type(m) is cls and (width is None or m.weight.shape[-1] == width):
            return m
    raise ValueError(f"fused ops: {type(model).__name__} has no {cls.__name__} module of width {width}")


def op_trials(
    model: nn.Module, stock: dict, dtype: torch.dtype, rows: int | None = None, positions: int | None = None
) -> dict[str, tuple]:
    """Per op: (fused call, stock call, shape, class key), each call a forward and backward (``fused_ops.fwd_bwd``)
    on the same random operands of ``rows`` x ``positions`` tokens (default: the probe's) at ``model``'s widths, in
    ``dtype``; the stock calls run the stock module's code (``stock``: :func:`install`'s) on a copy of the model's
    first norm and its MLP's activation. The run's trial and the benchmark (bench/fused_ops.py) time these."""
    cfg, g = model.config, torch.Generator().manual_seed(0)
    b, t, hidden = rows or PROBE_ROWS, positions or PROBE_POSITIONS, cfg.hidden_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or hidden // heads

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    norm = copy.deepcopy(_first(model, stock["norm"], hidden)).requires_grad_()
    x = rand(b, t, hidden)
    act = _first(model, stock["mlp"]).act_fn
    gate, up = rand(b, t, cfg.intermediate_size), rand(b, t, cfg.intermediate_size)
    q, k = rand(b, t, heads, d).transpose(1, 2), rand(b, t, kv_heads, d).transpose(1, 2)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1).expand(b, t, d)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    name = str(dtype).removeprefix("torch.")
    out = {
        RMS_NORM: (
            fwd_bwd(lambda x: rms_norm(x, norm.weight, norm.variance_epsilon), x),
            fwd_bwd(lambda x: stock["norm_forward"](norm, x), x),
            f"[{b * t}, {hidden}] {name}",
            (dtype, hidden),
        ),
        ROTARY: (
            fwd_bwd(lambda q, k: rotary(q, k, cos, sin), q, k),
            fwd_bwd(lambda q, k: stock["rotary"](q, k, cos, sin), q, k),
            f"[{b * t}, {heads}+{kv_heads} heads, {d}] {name}",
            (dtype, d),
        ),
    }
    if cfg.hidden_act in SILU:
        out[SWIGLU] = (
            fwd_bwd(swiglu, gate, up),
            fwd_bwd(lambda gate, up: act(gate) * up, gate, up),
            f"[{b * t}, {cfg.intermediate_size}] {name}",
            (dtype, cfg.intermediate_size),
        )
    return out


def _pinned() -> None:
    raise AssertionError("a process pinned to the torch paths runs no trial")


def choose_fused_ops(model: nn.Module, device: torch.device | str = "cpu") -> list[str]:
    """Swap the fused ops into ``model``'s architecture (:func:`install`), measure each (or read back a choice this
    process holds) and return the lines that state it; none on an accelerator or for another architecture."""
    stock = install(model) if torch.device(device).type == "cpu" else None
    if stock is None:
        return []
    dtype = next(model.parameters()).dtype
    unmeasured = [op for op in FUSED_OPS if recorded(op) is None]
    probes = op_trials(model, stock, dtype) if unmeasured and not pinned() else {}
    lines = []
    for op in FUSED_OPS:
        choice: KernelChoice | None = recorded(op)
        if choice is None and pinned():  # nothing is measured: the stock path, saying why
            choice = measure_op(op, _pinned, _pinned, "")
        if choice is None and op not in probes:
            lines.append(f"{op}: stock module (activation {model.config.hidden_act!r} is not SiLU)")
            continue
        if choice is None:
            fused, plain, shape, key = probes[op]
            choice = measure_op(op, fused, plain, f"{shape}, forward and backward")
            _MEASURED[op] = key
        spent = compile_seconds(op)
        lines.append(choice.describe() + (f" (compiled in {spent:.1f} s)" if spent else ""))
    return lines
