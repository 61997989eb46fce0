"""Does a checkpoint's weights fit the configured model? Answered from the files, before any model is built.

The checkpoint side is the safetensors header of ``model.safetensors`` (names, dtypes and shapes; no tensor is
read); the model side is the configured model built from its Hugging Face config on the ``meta`` device (shapes
only, no memory, no weights read). :func:`check_architecture` raises :class:`ArchitectureMismatchError` (a config
error: exit code 2) naming the first parameter that is missing, unexpected or of another shape, with both shapes.
``alignopsd eval --checkpoint`` checks every checkpoint; a resume checks when the config it runs with differs from
the checkpoint's (``--allow-config-change``), since an unchanged config implies the same shapes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from alignopsd.engine.config.schema import ConfigError

HEADER_LIMIT = 100 << 20  # bytes of a safetensors header read at most (names and shapes only)
_TIED = ("lm_head.weight",)  # left out of checkpoints of models whose output layer is the input embedding


class ArchitectureMismatchError(ConfigError):
    """The weights of a checkpoint do not fit the configured model (names the first parameter and both shapes)."""


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a safetensors file, from its header alone; ValueError when malformed."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(HEADER_LIMIT, path.stat().st_size - 8):
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: unreadable safetensors header (not a JSON object)")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{path}: the header entry of {name!r} has no valid shape")
        out[name] = tuple(shape)
    return out


def model_shapes(model_spec: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the state dict of model ``model_spec`` (Hugging Face layout), built from
    its config on the ``meta`` device (nothing allocated, no weights read)."""
    import torch
    from alignopsd.engine.models.loading import resolve_model_path
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(model_spec), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def first_mismatch(saved: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
    """The first difference between checkpoint shapes and model shapes (model order, then the checkpoint's extra
    names), as a sentence; None when the checkpoint fits (an output layer tied to the embedding may be absent)."""
    for name, shape in expected.items():
        if name not in saved:
            if name in _TIED:
                continue
            return f"parameter {name!r} (shape {list(shape)} in the configured model) is missing from the checkpoint"
        if saved[name] != shape:
            return (
                f"parameter {name!r} has shape {list(saved[name])} in the checkpoint and {list(shape)} in the "
                "configured model"
            )
    extra = next((n for n in saved if n not in expected), None)
    if extra is not None:
        return f"parameter {extra!r} (shape {list(saved[extra])}) of the checkpoint is not in the configured model"
    return None


def check_architecture(checkpoint: str | os.PathLike, model_spec: str, *, what: str = "checkpoint") -> None:
    """Raise ArchitectureMismatchError when ``checkpoint``'s ``model.safetensors`` does not fit ``model_spec``."""
    weights = Path(checkpoint) / "model.safetensors"
    try:
        saved = safetensors_shapes(weights)
    except (OSError, ValueError) as exc:
        raise ArchitectureMismatchError(f"{what} {checkpoint}: {exc}") from None
    why = first_mismatch(saved, model_shapes(model_spec))
    if why is not None:
        raise ArchitectureMismatchError(
            f"{what} {checkpoint} does not fit the configured model {model_spec!r}: {why}; use a checkpoint of this "
            "model, or set model.name to the model the checkpoint was trained from"
        )
