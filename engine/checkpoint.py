"""Atomic, resumable checkpoints.

Layout of one checkpoint (``<run>/checkpoints/step_000012/``)::

    model.safetensors      policy weights in Hugging Face layout (``transformers`` loads the folder)
    config.json            the model's Hugging Face config (when the policy has one)
    optimizer.pt           optimizer state (and LR scheduler state) of rank 0
    rng_rank<r>.pt         python / numpy / torch (/ cuda) RNG state of every rank
    trainer_state.json     step, data position, run config, metrics summary

Atomicity: everything is written into ``checkpoints/.tmp-step_000012`` first, flushed to disk,
and only then renamed to its final name with ``os.replace`` (a rename within one directory, atomic
on POSIX). A kill at any moment therefore leaves either the previous set of complete checkpoints
or the new one, never a half-written directory under a final name; stale ``.tmp-*`` folders are
ignored by :func:`latest_checkpoint` and removed by the next save. Only the newest ``keep_last``
complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STEP_RE = re.compile(r"^step_(\d{6,})$")
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---------------------------------------------------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA when present) generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------------------------
# discovery


def is_complete(path: Path) -> bool:
    """A checkpoint directory under its final name with a readable trainer state."""
    path = Path(path)
    if not path.is_dir() or not STEP_RE.match(path.name):
        return False
    try:
        with open(path / STATE_FILE) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(state.get("complete")) and (path / WEIGHTS_FILE).is_file()


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := STEP_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    cks = list_checkpoints(ckpt_dir)
    return cks[-1] if cks else None


# ---------------------------------------------------------------------------------------------------------------------
# save / load


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _plain_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies; tensors sharing storage (tied embeddings) become separate tensors."""
    out = {}
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"state_dict[{k!r}]: expected a tensor, got {type(v).__name__}")
        out[k] = v.detach().to("cpu").contiguous().clone()
    return out


def save_weights(path: str | os.PathLike, state_dict: dict[str, torch.Tensor], hf_config: Any = None) -> None:
    """Weights as ``model.safetensors`` (+ ``config.json``) in a folder transformers can load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_plain_state_dict(state_dict), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    if hf_config is not None:
        if hasattr(hf_config, "save_pretrained"):
            hf_config.save_pretrained(str(path))
        elif isinstance(hf_config, dict):
            with open(path / "config.json", "w") as f:
                json.dump(hf_config, f, indent=2)
        else:
            raise ValueError(f"hf_config: expected a transformers config or a dict, got {type(hf_config).__name__}")


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / WEIGHTS_FILE))


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    hf_config: Any = None,
    extra_files: dict[str, bytes] | None = None,
    keep_last: int = 2,
    rank: int = 0,
    world_size: int = 1,
    barrier=None,
    _fail_after: str | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; returns its final path.

    Every rank calls this (each stores its RNG state); rank 0 writes the weights, optimizer and
    trainer state and performs the rename. ``barrier`` synchronises ranks (None when single-process).
    ``_fail_after`` (tests only) raises after the named file is written to simulate a crash.
    """
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last: must be >= 1, got {keep_last}")
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".tmp-{step_dir_name(step)}"
    sync = barrier or (lambda: None)

    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    sync()
    torch.save(capture_rng_state(), tmp / f"rng_rank{rank}.pt")
    sync()
    if rank == 0:
        save_weights(tmp, model_state, hf_config)
        if _fail_after == WEIGHTS_FILE:
            raise RuntimeError("simulated crash after writing the weights")
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        if _fail_after == "optimizer.pt":
            raise RuntimeError("simulated crash after writing the optimizer")
        for name, blob in (extra_files or {}).items():
            (tmp / name).write_bytes(blob)
        state = dict(trainer_state)
        state.update(step=step, world_size=world_size, complete=True)
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(state, f, indent=2, default=str)
        if _fail_after == STATE_FILE:
            raise RuntimeError("simulated crash before the rename")
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it atomically
            old = ckpt_dir / f".old-{step_dir_name(step)}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        for stale in list_checkpoints(ckpt_dir)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    sync()
    return final


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0, restore_rng: bool = True) -> dict[str, Any]:
    """Read a complete checkpoint: {"model_state", "optimizer_state", "trainer_state", "path"}; restores RNG."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"checkpoint: {str(path)!r} is not a complete checkpoint")
    with open(path / STATE_FILE) as f:
        trainer_state = json.load(f)
    opt_path = path / "optimizer.pt"
    optimizer_state = torch.load(opt_path, map_location="cpu", weights_only=False) if opt_path.exists() else None
    if restore_rng:
        rng_path = path / f"rng_rank{rank}.pt"
        if not rng_path.exists():
            rng_path = path / "rng_rank0.pt"
        if rng_path.exists():
            restore_rng_state(torch.load(rng_path, map_location="cpu", weights_only=False))
    return {
        "model_state": load_weights(path),
        "optimizer_state": optimizer_state,
        "trainer_state": trainer_state,
        "path": path,
    }


def resolve_resume(resume: str | None, ckpt_dir: str | os.PathLike) -> Path | None:
    """``--resume``: None/'none' -> None; 'auto' -> newest complete checkpoint (or None); else a path."""
    if resume is None or resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(ckpt_dir)
    p = Path(resume)
    if not is_complete(p):
        raise ValueError(f"--resume: {resume!r} is not a complete checkpoint directory")
    return p
