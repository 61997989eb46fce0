"""Nested state (optimizer, scheduler, RNG states) as one safetensors file, without pickle.

``save_state(path, obj)`` splits ``obj`` into its tensors (stored as safetensors tensors ``t0, t1, ...``) and a
JSON skeleton of everything else (stored in the safetensors header's metadata), and ``load_state(path)`` puts
them back together exactly: ints stay ints, floats round-trip bit for bit (JSON uses ``repr``; inf and NaN
included), tuples stay tuples (Adam's ``betas``), dicts keep their key types (an optimizer's integer parameter
ids), numpy arrays keep dtype and shape (numpy's generator state). Reading never executes code: safetensors
holds raw tensor bytes and the skeleton is JSON.

Skeleton encoding: ``None``, bools, ints, floats and strings are JSON values; containers are one-key objects,
``{"d": [[key, value], ...]}`` (dict), ``{"l": [...]}`` (list), ``{"u": [...]}`` (tuple), ``{"t": name}`` (torch
tensor), ``{"n": name, "dtype": str, "shape": [...]}`` (numpy array, stored as its raw bytes).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

FORMAT = "alignopsd-state-1"


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()  # views and shared storage: safetensors stores whole, unshared tensors
    return t


def flatten_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, tensors by name) of a nested state; ValueError naming the path of an unsupported value."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # one stored tensor per storage: a tensor met twice (tied weights) is copied

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            name = f"t{len(tensors)}"
            t = _plain_tensor(x)
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
            return {"t": name}
        if isinstance(x, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8).copy())
            return {"n": name, "dtype": x.dtype.str, "shape": list(x.shape)}
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise ValueError(f"state{where}: key {k!r} of type {type(k).__name__} cannot be stored")
                items.append([k, enc(v, f"{where}[{k!r}]")])
            return {"d": items}
        if isinstance(x, (list, tuple)):
            body = [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
            return {"l": body} if isinstance(x, list) else {"u": body}
        raise ValueError(f"state{where}: a {type(x).__name__} cannot be stored without pickle")

    return enc(obj, ""), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`; ValueError on a malformed skeleton or a missing tensor."""

    def tensor(name: Any) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"state: tensor {name!r} is missing from the file")
        return tensors[name]

    def dec(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, dict) and len(x) >= 1:
            if "d" in x:
                return {k: dec(v) for k, v in x["d"]}
            if "l" in x:
                return [dec(v) for v in x["l"]]
            if "u" in x:
                return tuple(dec(v) for v in x["u"])
            if "t" in x:
                return tensor(x["t"])
            if "n" in x:
                raw = tensor(x["n"]).numpy()
                return raw.view(np.dtype(x["dtype"])).reshape(x["shape"]).copy()
        raise ValueError(f"state: malformed skeleton node {str(x)[:80]!r}")

    return dec(skeleton)


def save_state(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` (nested dicts/lists/tuples of tensors, numpy arrays and plain values) to ``path``."""
    from alignopsd.engine.infra.writes import writing
    from safetensors.torch import save_file

    skeleton, tensors = flatten_state(obj)
    meta = {"format": FORMAT, "skeleton": json.dumps(skeleton)}
    with writing(path):
        save_file(tensors, str(path), metadata=meta)


def load_state(path: str | os.PathLike) -> Any:
    """Read a file written by :func:`save_state` (no code runs while reading)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as exc:  # noqa: BLE001 - safetensors' error type is not a ValueError
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a state file of format {FORMAT!r}")
    try:
        skeleton = json.loads(meta["skeleton"])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable state skeleton ({exc})") from None
    return unflatten_state(skeleton, tensors)
