"""The one writer of Hugging Face weights: a folder transformers (and vLLM) load, written atomically with a manifest.

Every Hugging Face weight folder the engine writes goes through this module: a checkpoint's ``model.safetensors``
(the trainer's, and the gathered export of a sharded one; engine/checkpoint/checkpoint.py), the warm start ``alignopsd
sft`` writes (engine/commands/sft.py) and the model conversions of engine/models/loading.py.

* :func:`save_weights` writes ``model.safetensors`` (+ ``config.json``) into a folder that is still being built;
  :func:`save_model_files` does so for a transformers model (with its generation config, and the architecture
  recorded in ``config.json``, as ``save_pretrained`` records it).
* :func:`publish_folder` builds a whole folder in a temporary sibling, lists every file in its manifest
  (engine/checkpoint/manifest.py: each file flushed to disk first, the manifest last) and renames it into place
  (:func:`install_folder`), so a reader sees the previous folder or the complete new one, never a part.

Write failures (full disk, file size limit, I/O error) raise :class:`~alignopsd.engine.infra.writes.WriteFailure`
naming the file; the unfinished folder is removed. Folders written before the manifest existed still load (readers
of model folders do not require it; checkpoints always had one).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.checkpoint.manifest import fsync_dir, verify_manifest, write_manifest
from alignopsd.engine.infra.writes import writing

WEIGHTS_FILE = "model.safetensors"
ADAPTER_DIR = "adapter"  # a checkpoint's LoRA adapter folder (apart from the merged weights: transformers would
# otherwise take a folder holding both for an adapter and load it onto its base, the adapter applied twice)
ADAPTER_FILE = "adapter_model.safetensors"  # peft's names: PeftModel.from_pretrained(base, folder) reads them
ADAPTER_CONFIG_FILE = "adapter_config.json"


def plain_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
    with writing(path):
        path.mkdir(parents=True, exist_ok=True)
    with writing(path / WEIGHTS_FILE):
        save_file(plain_state_dict(state_dict), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    if hf_config is None:
        return
    with writing(path / "config.json"):
        if isinstance(hf_config, dict):
            with open(path / "config.json", "w") as f:
                json.dump(hf_config, f, indent=2)
        elif callable(getattr(hf_config, "save_pretrained", None)):
            hf_config.save_pretrained(str(path))
        else:
            raise ValueError(f"hf_config: expected a transformers config or a dict, got {type(hf_config).__name__}")


def save_model_files(path: str | os.PathLike, model) -> None:
    """A transformers model's weights, config (naming its architecture) and generation config into ``path``."""
    model.config.architectures = [type(model).__name__]
    save_weights(path, model.state_dict(), model.config)
    if model.can_generate():
        with writing(Path(path) / "generation_config.json"):
            model.generation_config.save_pretrained(str(path))


def save_adapter(path: str | os.PathLike, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """LoRA adapter weights and config in peft's layout (``adapter_model.safetensors`` + ``adapter_config.json``)
    into a folder that is still being built."""
    from safetensors.torch import save_file

    path = Path(path)
    with writing(path):
        path.mkdir(parents=True, exist_ok=True)
    with writing(path / ADAPTER_FILE):
        save_file(plain_state_dict(state_dict), str(path / ADAPTER_FILE), metadata={"format": "pt"})
    with writing(path / ADAPTER_CONFIG_FILE):
        (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))


def load_adapter(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter weights :func:`save_adapter` wrote into ``path`` (verified by the caller)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / ADAPTER_FILE))


def load_weights(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The weights of a folder, after verifying it against its manifest (``verify=False``: the caller has just
    verified it)."""
    from safetensors.torch import load_file

    if verify:
        verify_manifest(path, require=(WEIGHTS_FILE,))
    return load_file(str(Path(path) / WEIGHTS_FILE))


def install_folder(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final``, replacing an older ``final`` atomically: it is first renamed
    to ``.old-<name>`` beside it (which a kill between the two renames leaves, to be put back or removed by the
    folder's next writer), then removed."""
    parent = final.parent
    if final.exists():
        old = parent / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(parent)


def publish_folder(
    final: str | os.PathLike, fill: Callable[[Path], None], *, keep_existing: Callable[[Path], bool] | None = None
) -> Path:
    """Write a folder atomically: ``fill(tmp)`` writes its files into a temporary sibling of ``final``, the manifest
    lists them (each flushed to disk), then the folder is renamed to ``final``; returns ``final``.

    ``keep_existing``: for caches that concurrent processes may build at once: an existing ``final`` that
    ``keep_existing(final)`` finds incomplete or stale is removed, and the rename does not replace a folder (it fails
    when another process put one there first: that folder stays if ``keep_existing`` accepts it). Without it an
    existing ``final`` is replaced (:func:`install_folder`)."""
    final = Path(final)
    with writing(final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        fill(tmp)
        tmp.chmod(0o755)  # mkdtemp creates 0700
        write_manifest(tmp)
        if keep_existing is None:
            install_folder(tmp, final)
            return final
        if final.exists() and not keep_existing(final):
            shutil.rmtree(final, ignore_errors=True)  # stale, or half-written by an older version
        try:
            os.rename(tmp, final)  # never replaces a non-empty folder
        except OSError:
            if not keep_existing(final):  # another process won the race with a complete folder: keep theirs
                raise
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
