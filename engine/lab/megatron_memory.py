"""Per-rank accelerator memory of a Megatron run, computed from its config (no model is loaded).

    alignopsd memory --config FILE [--set k=v ...] [--world-size N] [--gpu-gib G]

Legend: P = parameters of the full model, S = parameters of one tensor-parallel shard, b = bytes per parameter of
the model dtype, tp / dp = tensor- / data-parallel size (world size = tp x dp), V = vocabulary, D = hidden size,
F = MLP width, nq / ng = query / key-value heads, hn = head dim, n = layers.

The shapes come from the model's ``config.json`` when the model is on this machine (a local folder or the local
Hugging Face cache), else from a built-in table of the paper's models. Per rank, in bytes:

    policy shard         S b
    gradients            4 S                   (megatron-core's gradient buffer reduces in fp32)
    optimizer            (4 S if b < 4) + 8 S  (fp32 main params for bf16/fp16 weights, Adam's two fp32 moments),
                                               divided by dp with the distributed optimizer
    reference (KL > 0)   before: P b (a full Hugging Face model); after: S b (a frozen snapshot of the shard)
    Hugging Face copy    before: P b on every rank; after: P b only with Hugging Face generation, and only on the
                         first rank of each tensor-parallel group (the one that generates for its group)
    vLLM                 gpu_memory_utilization x the accelerator's memory (weights P b, the rest KV cache and
                         vLLM's own buffers); before: on every rank; after: only on the first rank of each
                         tensor-parallel group, released in the training phases when vLLM can sleep (level 1:
                         weights to host memory, KV cache dropped) and taken back to generate
    weight sync          before: P b while the full weights are gathered from the shards (every rank, after the
                         update); after: 2 Q b on the first rank of each group (Q: the largest conversion part, the
                         embedding, one layer or the final norm with the untied head; its gathered pieces and its
                         converted weights), gathered there part by part; the other ranks only send their shards

S counts, per layer, the replicated norms 2 D and the tp-th part of q/k/v ((nq + 2 ng) hn D, plus biases), the
output projection nq hn D and the gated MLP 3 D F; plus the tp-th part of the embedding V D (and of the output
head V D when untied) and the final norm D. Activations are not counted (they depend on the batch and on
recomputation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from alignopsd.engine.policy.megatron.convert import Dims

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# config.json fields of the paper's models (used when the model is not on this machine)
BUILTIN_SHAPES: dict[str, dict] = {
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "Qwen/Qwen2.5-3B-Instruct": dict(
        model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16",
    ),
}  # fmt: skip


def model_fields(name: str) -> tuple[dict, str]:
    """(config.json fields of model ``name``, where they came from): the local ``config.json`` when the model
    resolves on this machine, else the built-in table."""
    from alignopsd.engine.models.loading import ModelNotFoundError, resolve_model_path

    try:
        path = Path(resolve_model_path(name)) / "config.json"
        return json.loads(path.read_text()), str(path)
    except (ModelNotFoundError, OSError):
        pass
    for key, fields in BUILTIN_SHAPES.items():
        if key.lower() == name.lower() or key.split("/")[-1].lower() == name.lower():
            return dict(fields), f"built-in table ({key})"
    raise ValueError(
        f"model.name: {name!r} is not on this machine and not in the built-in table "
        f"({', '.join(BUILTIN_SHAPES)}); pass a local folder with its config.json"
    )


def full_params(d: Dims) -> int:
    """P: parameters of the full model (Hugging Face layout; a tied output head counted once)."""
    return shard_params(d, 1)


def shard_params(d: Dims, tp: int) -> int:
    """S: parameters of one tensor-parallel shard (megatron-core's layout, ``convert.hf_to_megatron``)."""
    d.check_tp(tp)
    layer = layer_params(d, tp)
    heads = (1 if d.tied else 2) * d.vocab * d.hidden // tp
    return d.num_layers * layer + heads + d.hidden


def layer_params(d: Dims, tp: int) -> int:
    """Parameters of one decoder layer's shard: its replicated norms and the tp-th part of the rest."""
    qkv = (d.heads + 2 * d.groups) * d.head_dim
    attention = qkv * d.hidden + (qkv if d.qkv_bias else 0) + d.heads * d.head_dim * d.hidden
    return 2 * d.hidden + (attention + 3 * d.hidden * d.ffn) // tp


def sync_part_params(d: Dims) -> int:
    """Q: parameters of the largest conversion part of the weight sync (``convert.conversion_parts``): the
    embedding (with a tied head, the same tensor), one decoder layer, or the final norm with an untied head."""
    return max(d.vocab * d.hidden, layer_params(d, 1), d.hidden + (0 if d.tied else d.vocab * d.hidden))


def kv_bytes_per_token(d: Dims, dtype_bytes: int) -> int:
    """KV-cache bytes of one token (keys and values of every layer)."""
    return 2 * d.num_layers * d.groups * d.head_dim * dtype_bytes


@dataclass(frozen=True)
class Layout:
    """What one rank holds (sizes in bytes; see the module docstring); a run config's: engine/commands/memory.py
    ``layout_from_config``."""

    dims: Dims
    dtype_bytes: int
    tp: int
    dp: int
    distributed_optimizer: bool
    reference: bool
    hf_generation: bool
    vllm: bool
    vllm_sleep: bool
    gpu_bytes: int
    gpu_memory_utilization: float

    def rows(self) -> list[tuple[str, int, int, int, int]]:
        """(item, before, after: training phases and generating on the first rank of a tensor-parallel group,
        after: the group's other ranks) per rank, in bytes. The other ranks hold no generation engine, so their
        training and generating phases are the same."""
        d, b = self.dims, self.dtype_bytes
        p, s = full_params(d), shard_params(d, self.tp)
        opt = (8 + (4 if b < 4 else 0)) * s
        opt = opt // self.dp if self.distributed_optimizer else opt
        ref_before, ref_after = (p * b, s * b) if self.reference else (0, 0)
        copy_after = p * b if self.hf_generation else 0
        engine = int(self.gpu_memory_utilization * self.gpu_bytes) if self.vllm else 0
        engine_training = 0 if self.vllm_sleep else engine
        sync = 2 * sync_part_params(d) * b
        return [
            ("policy shard (weights)", s * b, s * b, s * b, s * b),
            ("gradients (fp32 buffer)", 4 * s, 4 * s, 4 * s, 4 * s),
            ("optimizer (fp32 main + Adam moments)", opt, opt, opt, opt),
            ("reference model", ref_before, ref_after, ref_after, ref_after),
            ("Hugging Face copy of the policy", p * b, copy_after, copy_after, 0),
            ("vLLM (weights + KV cache)", engine, engine_training, engine, 0),
            ("weight-sync gather (transient)", p * b, sync, sync, 0),
        ]

    def vllm_kv_bytes(self) -> int:
        """The engine's share left after its weights (KV cache and vLLM's own buffers)."""
        return max(0, int(self.gpu_memory_utilization * self.gpu_bytes) - full_params(self.dims) * self.dtype_bytes)


def model_dims(name: str, dtype: str) -> tuple[Dims, int, str]:
    """(shapes of model ``name``, bytes per weight of ``dtype``, where the shapes came from: :func:`model_fields`).
    ``dtype`` ``auto`` is the dtype of the model's config.json, else bfloat16."""
    fields, source = model_fields(name)
    dtype = dtype if dtype != "auto" else str(fields.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"model.dtype: no byte size known for {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    return Dims.from_hf_config(SimpleNamespace(**fields)), DTYPE_BYTES[dtype], source


def format_table(layout: Layout) -> str:
    """The per-rank table (GiB) with its totals (without tensor parallelism every rank is a group's first)."""
    rows = layout.rows()
    others = layout.tp > 1
    lines = [
        "| per rank (GiB) | before (every rank) | after, TP rank 0: training phases | after, TP rank 0: generating "
        "| after, other TP ranks |",
        "|---|---:|---:|---:|---:|",
    ]

    def cells(vals) -> str:
        return " | ".join("–" if v is None or (i == 3 and not others) else f"{v / GIB:.2f}" for i, v in enumerate(vals))

    for name, *vals in rows:
        lines.append(f"| {name} | {cells(vals)} |")
    resident = [sum(r[i] for r in rows[:-1]) for i in (1, 2, 3, 4)]
    lines.append("| **resident total** | " + " | ".join(f"**{c}**" for c in cells(resident).split(" | ")) + " |")
    # the weights are gathered after the update and pushed into an awake engine: the generating column's set
    peak = [resident[0] + rows[-1][1], None, resident[2] + rows[-1][3], resident[3] + rows[-1][4]]
    lines.append(f"| peak at weight sync (resident + gather) | {cells(peak)} |")
    return "\n".join(lines)


def describe(layout: Layout, source: str) -> str:
    d = layout.dims
    p, s = full_params(d), shard_params(d, layout.tp)
    return (
        f"shapes from {source}: {d.num_layers} layers, hidden {d.hidden}, MLP {d.ffn}, heads {d.heads} "
        f"(kv {d.groups}, dim {d.head_dim}), vocab {d.vocab}, {'tied' if d.tied else 'untied'} head; "
        f"P = {p / 1e9:.3f} B parameters, S = {s / 1e9:.3f} B per shard; {layout.dtype_bytes} bytes per weight; "
        f"tp {layout.tp} x dp {layout.dp}; distributed optimizer {'on' if layout.distributed_optimizer else 'off'}; "
        f"reference {'on' if layout.reference else 'off'}; generation {'vLLM' if layout.vllm else 'Hugging Face'}"
        + (
            f" (gpu_memory_utilization {layout.gpu_memory_utilization} of {layout.gpu_bytes / GIB:.0f} GiB: "
            f"{layout.vllm_kv_bytes() / GIB:.2f} GiB after its weights for KV cache and buffers, "
            f"{kv_bytes_per_token(d, layout.dtype_bytes) / 1024:.0f} KiB per token; sleep "
            f"{'on' if layout.vllm_sleep else 'off'})"
            if layout.vllm
            else ""
        )
    )
