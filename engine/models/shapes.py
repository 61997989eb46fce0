"""The shapes of a decoder-only transformer that its cost depends on, from its Hugging Face config.

:func:`resolve_shape` reads ``config.json`` of a local model folder (hidden size, layers, attention heads,
key/value heads, MLP width, vocabulary, tied head); when the folder is absent it falls back to a small table of
known architectures with their published shapes (:data:`KNOWN_SHAPES`) and says so in ``ModelShape.source``; a
name that is neither raises ``ValueError`` naming the value and the names the table knows.

Counting (per layer, forward): the q/k/v/o projections and the gated MLP (gate, up, down) are
``2 * params`` FLOPs per token; attention is ``4 * heads * head_dim * context`` FLOPs per query position
(scores and the weighted sum of values); the output head is ``2 * hidden * vocab`` per position whose logits are
computed. Biases, norms, rotary embeddings and the softmax are left out (under 1 % at these sizes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_head: bool
    head_dim: int = 0  # 0: hidden // heads
    source: str = ""  # where the numbers come from (a config.json, or the published-shape table)

    def __post_init__(self) -> None:
        for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"model shape {self.name!r}: {k} must be >= 1, got {getattr(self, k)}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model shape {self.name!r}: heads {self.heads} not a multiple of kv_heads {self.kv_heads}"
            )

    @property
    def dim(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Weights of the matmuls of one layer: q, k, v, o and the gated MLP."""
        q = self.hidden * self.heads * self.dim
        kv = 2 * self.hidden * self.kv_heads * self.dim
        o = self.heads * self.dim * self.hidden
        return q + kv + o + 3 * self.hidden * self.intermediate

    @property
    def linear_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def params(self) -> int:
        """All weights: layers, output head, and the input embedding when it is not the head."""
        return self.linear_params + self.head_params * (1 if self.tied_head else 2)

    def linear_flops(self, tokens: float) -> float:
        return 2.0 * self.linear_params * tokens

    def head_flops(self, positions: float) -> float:
        return 2.0 * self.head_params * positions

    def attention_flops(self, queries: float, mean_context: float) -> float:
        return 4.0 * self.layers * self.heads * self.dim * queries * mean_context

    def kv_bytes_per_position(self, dtype_bytes: float) -> float:
        """Bytes of keys and values of one position over all layers."""
        return 2.0 * self.layers * self.kv_heads * self.dim * dtype_bytes

    def activation_bytes_per_token(self, dtype_bytes: float) -> float:
        """Bytes a training forward keeps per token for its backward, over all layers: per layer about eight
        hidden-wide tensors (the norms' inputs and outputs, queries, the attention output, the residuals), three
        key/value-wide ones (keys, values, rotated keys) and four MLP-wide ones (gate, up, the activation, their
        product). SmolLM2-135M in fp32: 1.30 MiB per token; measured over a forward and backward of two 1,000-token
        rows, 1.26 MiB packed and 1.47 MiB padded beyond the weights' gradients (engine/observe/memory.py's peak)."""
        per_layer = 8 * self.hidden + 3 * self.kv_heads * self.dim + 4 * self.intermediate
        return float(self.layers * per_layer * dtype_bytes)

    def weight_bytes(self, dtype_bytes: float) -> float:
        """Bytes a forward reads from weights: the layers and the head (the embedding is a gather)."""
        return (self.linear_params + self.head_params) * dtype_bytes


# Published shapes (each model's config.json on its model card): hidden, layers, heads, kv heads, MLP, vocab, tied.
KNOWN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, True),
        ModelShape("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True),
        ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False),
        ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, False),
    )
}


def known_key(name: str) -> str | None:
    """The table's key for a model name (``Qwen/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b``), None when unknown."""
    base = str(name).rstrip("/").split("/")[-1].lower()
    for suffix in ("-instruct", "-it", "-chat", "-base"):
        base = base.removesuffix(suffix)
    base = base.replace("meta-llama-", "llama-")
    return base if base in KNOWN_SHAPES else None


def shape_from_hf_config(cfg: dict, name: str, source: str) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` mapping (ValueError naming a missing key)."""
    keys = {
        "hidden": "hidden_size",
        "layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "intermediate": "intermediate_size",
        "vocab": "vocab_size",
    }
    missing = [v for v in keys.values() if v not in cfg]
    if missing:
        raise ValueError(f"model {name!r}: its config ({source}) has no {', '.join(missing)}")
    vals = {k: int(cfg[v]) for k, v in keys.items()}
    return ModelShape(
        name=name,
        kv_heads=int(cfg.get("num_key_value_heads") or vals["heads"]),
        tied_head=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=int(cfg.get("head_dim") or 0),
        source=source,
        **vals,
    )


def _from_folder(name: str, source: str) -> ModelShape:
    from alignopsd.engine.models.loading import resolve_model_path

    cfg = json.loads((Path(resolve_model_path(str(name))) / "config.json").read_text())
    return shape_from_hf_config(cfg.get("text_config", cfg), str(name), source)


def resolve_shape(name: str) -> ModelShape:
    """The shape of model ``name``: its folder's ``config.json`` when the folder exists, else the published table."""
    path = Path(str(name)).expanduser()
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        return shape_from_hf_config(cfg.get("text_config", cfg), path.name, "config.json of the model folder")
    if str(name).lower() in ("tiny", "tiny-bpe"):  # the engine's embedded test models (engine/models/loading.py)
        return _from_folder(name, "the engine's embedded test model")
    key = known_key(name)
    if key is None:
        try:  # a Hugging Face id in the local cache
            return _from_folder(name, "config.json in the local Hugging Face cache")
        except Exception:  # noqa: BLE001  (any failure to find it is the error below)
            pass
        raise ValueError(
            f"model.name: cannot size {name!r}: no config.json at that path and not a known architecture "
            f"(known: {', '.join(KNOWN_SHAPES)})"
        )
    where = "no local folder" if ("/" in str(name) or path.exists()) else "built-in name"
    return replace(KNOWN_SHAPES[key], source=f"published shape of {key} ({where}: model folder absent)")
