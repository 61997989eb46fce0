"""Reading a ``torch.distributed.checkpoint`` (DCP) folder without running code from it.

DCP stores its index, ``.metadata``, as a pickle, and non-tensor values of the state (hyper-parameters, step
counts) as pickles inside the shard files; its stock reader unpickles the first with ``pickle.load`` and the
second with ``torch.load(weights_only=False)``, so a forged file runs whatever code it names (the manifest's
checksums catch damage, not forgery: whoever rewrites a file can rewrite the manifest). Here:

* :func:`read_metadata` unpickles ``.metadata`` with :class:`MetadataUnpickler`, which admits only DCP's own
  metadata classes and the few torch/standard-library names they are pickled with (:data:`ALLOWED`: ``torch.Size``,
  dtypes, the layout helper, ``pathlib`` paths); anything else is refused before it is looked up, and nothing in
  the file is called. The result is then checked: a ``Metadata`` whose storage entries name only shard files
  listed for the folder (``listed``), with non-negative offsets and lengths.
* :func:`safe_reader` (a ``FileSystemReader`` whose ``read_metadata`` is the above) and :func:`safe_load_planner`
  (a ``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``) are what
  :func:`load` hands to ``dcp.load``: the Megatron backend's sharded load goes through them.

A refusal raises :class:`UnsafeCheckpointError` (a ``ManifestError``: a run refuses the checkpoint like a corrupt
one, exit code 2).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.checkpoint.manifest import ManifestError

METADATA = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
# (module, name) pairs a DCP ``.metadata`` pickle may name; dtypes (``torch.float32``, ...) are admitted by type
ALLOWED = frozenset(
    {(_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
       ("collections", "OrderedDict")}
)  # fmt: skip


class UnsafeCheckpointError(ManifestError):
    """A DCP folder's metadata names something other than DCP's metadata types, or files outside the folder."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: every global the pickle names must be in :data:`ALLOWED` (or a torch dtype)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which is not a torch.distributed.checkpoint metadata type"
        )


def read_metadata(folder: str | os.PathLike, listed: set[str] | None = None, *, name: str = METADATA):
    """The ``Metadata`` of DCP folder ``folder``, unpickled with :class:`MetadataUnpickler` and checked;
    ``listed``: the files of the folder its storage entries may name (None: any plain file name)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / name
    try:
        with open(path, "rb") as f:
            md = MetadataUnpickler(f).load()
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable ({exc.strerror})") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a refusal with its reason
        raise UnsafeCheckpointError(f"{path}: refused ({exc}); a forged or foreign file?") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{path}: refused (not torch.distributed.checkpoint metadata)")
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        ok = isinstance(info, _StorageInfo) and isinstance(rel, str) and rel and "/" not in rel and rel != ".."
        ok = ok and (listed is None or rel in listed)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length))
        if not ok:
            raise UnsafeCheckpointError(
                f"{path}: refused (the entry of {getattr(index, 'fqn', index)!r} names "
                f"{rel!r}, not a listed shard file of the folder, or a bad range)"
            )
    return md


def safe_reader(path: str | os.PathLike, listed: set[str] | None = None):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """``FileSystemReader`` whose metadata goes through :func:`read_metadata` (never plain ``pickle.load``)."""

        def __init__(self, path: str | os.PathLike, listed: set[str] | None = None) -> None:
            super().__init__(path)
            self.listed = listed

        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            name = METADATA if rank is None else f"__{rank}{METADATA}"
            md = read_metadata(self.path, self.listed, name=name)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(path, listed)


def safe_load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` whose non-tensor values are read with ``torch.load(weights_only=True)`` (the stock
        one uses ``weights_only=False``); placed where the stock method places them."""

        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def load(state: dict[str, Any], folder: str | os.PathLike, listed: set[str] | None = None) -> None:
    """``dcp.load(state)`` from ``folder`` through :func:`safe_reader` and :func:`safe_load_planner`."""
    import torch.distributed.checkpoint as dcp

    read_metadata(folder, listed)  # refused here with its reason (dcp.load would wrap it in its own exception)
    dcp.load(state, storage_reader=safe_reader(folder, listed), planner=safe_load_planner())
