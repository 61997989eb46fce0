"""Atomic, verified, resumable checkpoints; nothing in them is unpickled.

Layout of one checkpoint (``<run>/checkpoints/step_000012/``)::

    model.safetensors          policy weights in Hugging Face layout (``transformers`` loads the folder)
    config.json                the model's Hugging Face config (when the policy has one)
    optimizer.safetensors      optimizer (and LR scheduler) state of rank 0, tensors + JSON (statefile.py)
    rng_rank<r>.safetensors    python / numpy / torch (/ cuda) RNG state of every rank, tensors + JSON
    trainer_state.json         step, data position, the resolved run config, metrics summary
    manifest.json              every file above with its size and CRC-32 (manifest.py), and the checkpoint
                               format's version (trainer_state.py: ``format_version``), written last

A LoRA checkpoint (engine/policy/lora.py) holds the adapter in peft's layout in ``adapter/`` (adapter_model.safetensors
+ adapter_config.json, for ``PeftModel.from_pretrained``) and the optimizer file, and its trainer state names the base
the adapter was trained over (``lora_base``: the model and a digest of its weights); its ``model.safetensors`` (+
``config.json``) is the merged model, written only on the steps the caller asks for, never read back to resume.

A sharded checkpoint (a backend with its own sharded save, the Megatron one) holds ``shards/`` instead of the
optimizer file: the backend's ``torch.distributed.checkpoint`` folder (model shards, optimizer and scheduler
state, written by every rank; see the backend's ``save_checkpoint``), listed in the same manifest as every
other file; ``trainer_state.json`` says ``"sharded": true``. Its ``model.safetensors`` (+ ``config.json``) is a
Hugging Face export of the gathered weights, written only on the steps the caller asks for (the trainer: every
``trainer.checkpoint.export_hf_freq`` steps and at the end of the run), for evaluation and serving; it is never read
back to resume.

Atomicity: everything is written into ``checkpoints/.tmp-step_000012`` first (the weights by the engine's one weight
writer, weights.py), flushed to disk, listed in the manifest, and only then renamed to its final name with
``os.replace`` (``install_folder``) (a rename within one directory, atomic
on POSIX). A kill at any moment therefore leaves either the previous set of complete checkpoints or the new
one, never a half-written directory under a final name; stale ``.tmp-*`` folders are ignored by
:func:`latest_checkpoint` and ``--resume auto`` and removed when the next save starts
(:func:`remove_unfinished`). Only the newest ``keep_last`` complete checkpoints are kept.

Write failures: a full disk, a file size limit or an I/O error while saving raises
:class:`~alignopsd.engine.infra.writes.WriteFailure` naming the file and the cause (the entry points exit with
status 1); the unfinished folder is removed and the complete checkpoints stay as they were.

Trust: :func:`load_checkpoint` verifies the manifest (sizes and checksums) before reading any file and refuses
a checkpoint that is incomplete, corrupted or missing a part, naming the file, whose trainer state has a field of
the wrong type or range, or whose sharded index (DCP's pickled ``.metadata``) names anything but DCP's metadata
types or a listed shard file (engine/checkpoint/safe_dcp.py: nothing in it is called); ``--resume auto`` falls back to
the newest checkpoint that verifies (:func:`resolve_resume`) and refuses to start over in a folder whose
checkpoints all fail. Weights that are not finite are never written (:class:`UnsafeStateError`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.checkpoint.manifest import (
    MANIFEST,
    ManifestError,
    file_entry,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from alignopsd.engine.checkpoint.rng_state import capture_rng_state, restore_rng_state
from alignopsd.engine.checkpoint.statefile import load_state, save_state
from alignopsd.engine.checkpoint.trainer_state import (
    FORMAT_VERSION,
    STATE_FILE,
    CheckpointFormatError,
    LoadedCheckpoint,
    TrainerState,
    format_version,
    read_trainer_state,
    write_trainer_state,
)
from alignopsd.engine.checkpoint.weights import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_DIR,
    ADAPTER_FILE,
    WEIGHTS_FILE,
    install_folder,
    load_adapter,
    load_weights,
    save_adapter,
    save_weights,
)
from alignopsd.engine.infra.writes import WriteFailure, writing

STEP_RE = re.compile(r"^step_(\d{6,})$")
OPTIMIZER_FILE = "optimizer.safetensors"
SHARDS_DIR = "shards"
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/{ADAPTER_FILE}"
ADAPTER_CONFIG = f"{ADAPTER_DIR}/{ADAPTER_CONFIG_FILE}"
SHARDS_METADATA = f"{SHARDS_DIR}/.metadata"  # written last by torch.distributed.checkpoint: the shards are all there


class UnsafeStateError(RuntimeError):
    """The state to be saved is not finite; nothing was written (the message names the last good checkpoint)."""


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---------------------------------------------------------------------------------------------------------------------
# discovery


def _require_weights(path: Path, files: dict[str, Any]) -> None:
    """A checkpoint holds its weights: the Hugging Face weights file, a sharded folder or a LoRA adapter."""
    if WEIGHTS_FILE not in files and SHARDS_METADATA not in files and ADAPTER_WEIGHTS not in files:
        raise ManifestError(
            f"{path}: none of {WEIGHTS_FILE!r}, {SHARDS_METADATA!r}, {ADAPTER_WEIGHTS!r} is listed in {MANIFEST} "
            "(missing part)"
        )


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint directory under its final name whose manifest lists the weights and the trainer state and
    whose files have the listed sizes (cheap: no checksums; :func:`verify_checkpoint` checks those)."""
    path = Path(path)
    if not path.is_dir() or not STEP_RE.match(path.name):
        return False
    try:
        _require_weights(path, verify_manifest(path, checksums=False, require=(STATE_FILE,)))
    except ManifestError:
        return False
    return True


# checkpoints this process has verified, with the (size, mtime_ns) of each file then: a resume verifies the same
# checkpoint when choosing it, when checking its config and when loading it, and hashes it only once
_VERIFIED: dict[str, tuple] = {}


def _stat_key(path: Path, names: list[str]) -> tuple | None:
    try:
        stats = [(rel, os.stat(path / rel)) for rel in [MANIFEST, *names]]
    except OSError:
        return None
    return tuple((rel, st.st_size, st.st_mtime_ns, st.st_ino) for rel, st in stats)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Verify every file of a checkpoint against its manifest; ManifestError names the bad file. Checksums are
    computed once per process while no file of the checkpoint changes (size, modification time, inode)."""
    path = Path(path)
    key = str(path.resolve())
    format_version(path)  # a newer format is refused before anything else of it is read
    files = verify_manifest(path, checksums=False, require=(STATE_FILE,))
    _require_weights(path, files)
    before = _stat_key(path, sorted(files))
    if before is not None and _VERIFIED.get(key) == before:
        return files
    _VERIFIED.pop(key, None)
    files = verify_manifest(path, require=(STATE_FILE,))
    read_trainer_state(path)
    if SHARDS_METADATA in files:  # DCP's pickled index, through the restricted unpickler (safe_dcp.py)
        from alignopsd.engine.checkpoint.safe_dcp import read_metadata

        prefix = f"{SHARDS_DIR}/"
        read_metadata(path / SHARDS_DIR, {k[len(prefix) :] for k in files if k.startswith(prefix)})
    if before is not None and _stat_key(path, sorted(files)) == before:  # unchanged while it was hashed
        _VERIFIED[key] = before
    return files


def _step_dirs(ckpt_dir: Path) -> list[Path]:
    """Every directory under a final checkpoint name, oldest first (complete or not)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in _step_dirs(Path(ckpt_dir)) if is_complete(p)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    cks = list_checkpoints(ckpt_dir)
    return cks[-1] if cks else None


# ---------------------------------------------------------------------------------------------------------------------
# save / load


def check_finite(
    state_dict: dict[str, torch.Tensor],
    *,
    step: int,
    ckpt_dir: str | os.PathLike,
    gather: Callable[[Any], list[Any]] | None = None,
) -> None:
    """Raise UnsafeStateError when a floating-point tensor holds NaN or inf (names the tensor and the newest
    complete checkpoint, from which the run can be resumed). ``gather`` (all-gather of a Python object): every
    rank checks its own part (shards) and all raise when any part is bad."""
    bad = next(
        (
            k
            for k, v in state_dict.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
        ),
        None,
    )
    if gather is not None:
        bad = next((b for b in gather(bad) if b is not None), None)
    if bad is not None:
        last = latest_checkpoint(ckpt_dir)
        where = f"the last good checkpoint is {last}" if last else "there is no earlier checkpoint"
        raise UnsafeStateError(
            f"weights at step {step} are not finite ({bad!r} holds NaN or inf); nothing was saved and the run "
            f"stops; {where}"
        )


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    *,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any] | None,
    trainer_state: TrainerState | None = None,
    hf_config: Any = None,
    extra_files: dict[str, bytes] | None = None,
    keep_last: int = 2,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    gather: Callable[[Any], list[Any]] | None = None,
    shards: Callable[[Path], None] | None = None,
    shard_state: dict[str, torch.Tensor] | None = None,
    adapter: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; returns its final path.

    Every rank calls this (each stores its RNG state and checksums it); rank 0 writes the weights, optimizer
    and trainer state, the manifest, and performs the rename. ``barrier`` synchronises ranks and ``gather``
    (all-gather of a Python object) brings each rank's manifest entry to rank 0; both None when
    single-process (without ``gather`` rank 0 checksums the other ranks' files itself). Non-finite weights
    raise UnsafeStateError on every rank before anything is written. ``trainer_state`` (its ``step`` is ``step``;
    None: the step alone) is stored with the save's own fields (``world_size``, ``sharded``, ``complete``), and the
    manifest with this code's ``format_version``.

    Sharded: ``shards(folder)`` is called on every rank (collectively) to write the backend's sharded state into
    ``<tmp>/shards`` together with that folder's own manifest, whose entries the checkpoint's manifest takes
    over; ``shard_state`` is this rank's part of the weights (checked for NaN/inf on every rank) and
    ``model_state`` the optional Hugging Face export (None: no ``model.safetensors``).

    LoRA: ``adapter`` is (weights, config) in peft's layout, written as ``adapter_model.safetensors`` +
    ``adapter_config.json`` in ``adapter/``; ``model_state`` is then the optional merged export.
    """
    _check_save_args(step, keep_last, has_weights=not (model_state is None and shards is None and adapter is None))
    state = _saved_state(trainer_state, step, world_size=world_size, sharded=shards is not None)
    ckpt_dir = Path(ckpt_dir)
    _check_weights(
        step,
        ckpt_dir,
        shard_state=(shard_state or {}) if shards is not None else None,
        exports=(model_state, adapter[0] if adapter is not None else None),
        gather=gather,
    )
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".tmp-{step_dir_name(step)}"
    sync = barrier or (lambda: None)

    if rank == 0:
        with writing(ckpt_dir):
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            remove_unfinished(ckpt_dir)
            tmp.mkdir()
    sync()
    try:
        entries = _write_rank_files(tmp, rank, gather=gather, sync=sync, shards=shards)
        if rank == 0:
            _write_rank0_files(tmp, model_state, optimizer_state, state, hf_config, extra_files, adapter)
            # flushes every file, then the manifest, last
            write_manifest(tmp, entries, fields={"format_version": FORMAT_VERSION})
    except WriteFailure as exc:
        raise _abandoned(exc, tmp if rank == 0 else None, ckpt_dir, step) from None
    if rank == 0:
        _install(tmp, final, keep_last)
    sync()
    return final


def _check_weights(
    step: int,
    ckpt_dir: Path,
    *,
    shard_state: dict[str, torch.Tensor] | None,
    exports: tuple[dict[str, torch.Tensor] | None, ...],
    gather: Callable[[Any], list[Any]] | None,
) -> None:
    """:func:`check_finite` of the weights a save writes (None: not written): this rank's part of the shards
    (every rank checks its own, all raise when any part is bad), then the full weights or the adapter."""
    if shard_state is not None:
        check_finite(shard_state, step=step, ckpt_dir=ckpt_dir, gather=gather)
    for weights in exports:
        if weights is not None:
            check_finite(weights, step=step, ckpt_dir=ckpt_dir)


def _write_rank_files(
    tmp: Path,
    rank: int,
    *,
    gather: Callable[[Any], list[Any]] | None,
    sync: Callable[[], None],
    shards: Callable[[Path], None] | None,
) -> dict[str, dict[str, Any]]:
    """The files every rank writes into ``tmp``: its RNG state and (collectively) its part of the backend's shards.
    Returns the manifest entries rank 0 takes over: every rank's RNG file (through ``gather``; without it rank 0
    checksums them itself) and the shards' own manifest."""
    save_state(tmp / rng_file(rank), capture_rng_state())
    mine = {rng_file(rank): file_entry(tmp / rng_file(rank))}
    entries: dict[str, dict[str, Any]] = {}
    if gather is not None:
        for part in gather(mine):
            entries.update(part)
    else:
        sync()
    if shards is not None:
        with writing(tmp / SHARDS_DIR):
            shards(tmp / SHARDS_DIR)  # collective; returns once every rank's files and its manifest are written
        if rank == 0:
            entries.update({f"{SHARDS_DIR}/{k}": v for k, v in read_manifest(tmp / SHARDS_DIR).items()})
    return entries


def _install(tmp: Path, final: Path, keep_last: int) -> None:
    """Rank 0: the finished folder under its final name (``install_folder``), then only the newest ``keep_last``
    complete checkpoints kept."""
    install_folder(tmp, final)
    for stale in list_checkpoints(final.parent)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)


def _check_save_args(step: int, keep_last: int, *, has_weights: bool) -> None:
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last: must be >= 1, got {keep_last}")
    if not has_weights:
        raise ValueError("model_state: required unless the checkpoint is sharded (shards=...) or holds an adapter")


def _saved_state(trainer_state: TrainerState | None, step: int, *, world_size: int, sharded: bool) -> TrainerState:
    """The trainer state a save stores: the caller's (None: the step alone) with the save's own fields."""
    if trainer_state is not None and trainer_state.step != step:
        raise ValueError(f"trainer_state.step: {trainer_state.step} is not the step saved ({step})")
    state = trainer_state or TrainerState(step=step)
    return dataclasses.replace(state, world_size=world_size, sharded=sharded, complete=True)


def _abandoned(exc: WriteFailure, tmp: Path | None, ckpt_dir: Path, step: int) -> WriteFailure:
    """A save that could not be written: its folder removed (``tmp``: on the rank that made it), the failure told
    with the newest complete checkpoint, which stays as it is."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # gives the space back
    last = latest_checkpoint(ckpt_dir)
    where = f"the last complete checkpoint {last} is untouched" if last else "there is no complete checkpoint"
    return exc.with_note(f"checkpoint of step {step} not saved; {where}")


def remove_unfinished(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Remove what interrupted saves left in ``ckpt_dir``: ``.tmp-step_*`` folders, and the ``.old-step_*`` copy
    of a re-saved step (put back under its name when a kill between the two renames of ``install_folder`` left the
    step without one). Returns the removed paths; called when a save starts."""
    ckpt_dir = Path(ckpt_dir)
    gone = []
    for p in sorted(ckpt_dir.iterdir()):
        if p.name.startswith(".old-step_") and not (ckpt_dir / p.name[len(".old-") :]).exists():
            os.replace(p, ckpt_dir / p.name[len(".old-") :])
        elif p.name.startswith((".tmp-step_", ".old-step_")):
            gone.append(p)
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def _write_rank0_files(
    tmp: Path,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any] | None,
    trainer_state: TrainerState,
    hf_config: Any,
    extra_files: dict[str, bytes] | None,
    adapter: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
) -> None:
    """The files rank 0 writes into the unfinished checkpoint folder (everything but the manifest)."""
    if adapter is not None:
        save_adapter(tmp / ADAPTER_DIR, *adapter)
    if model_state is not None:
        save_weights(tmp, model_state, hf_config)
    if optimizer_state is not None:
        save_state(tmp / OPTIMIZER_FILE, optimizer_state)
    for name, blob in (extra_files or {}).items():
        with writing(tmp / name):
            (tmp / name).write_bytes(blob)
    write_trainer_state(tmp, trainer_state)


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0, restore_rng: bool = True) -> LoadedCheckpoint:
    """Verify, then read a checkpoint (:class:`~alignopsd.engine.checkpoint.trainer_state.LoadedCheckpoint`).

    Every file is checked against the manifest before any is read (ManifestError names a missing, truncated
    or corrupted file). ``rng_state`` is this rank's generator state (None when the checkpoint was written by
    fewer ranks: the caller derives one, :func:`derived_rng_state`); ``restore_rng`` restores it right away.
    A sharded checkpoint gives ``shards`` (the verified folder, for the backend's sharded load) and
    ``model_state`` None (its Hugging Face export, if any, is not read); otherwise ``shards`` is None. A LoRA
    checkpoint gives ``adapter_state`` (peft's layout) and ``model_state`` None (its merged export is not read)."""
    path = Path(path)
    if not path.is_dir() or not STEP_RE.match(path.name):
        raise ValueError(f"checkpoint: {str(path)!r} is not a checkpoint directory (step_NNNNNN)")
    files = verify_checkpoint(path)
    trainer_state = read_trainer_state(path)
    sharded = trainer_state.sharded
    if sharded and SHARDS_METADATA not in files:
        raise ManifestError(f"{path}: {SHARDS_METADATA!r} is not listed in {MANIFEST} (missing part)")
    adapter = ADAPTER_WEIGHTS in files
    if adapter and ADAPTER_CONFIG not in files:
        raise ManifestError(f"{path}: {ADAPTER_CONFIG!r} is not listed in {MANIFEST} (missing part)")
    if not sharded and not adapter and WEIGHTS_FILE not in files:
        raise ManifestError(f"{path}: {WEIGHTS_FILE!r} is not listed in {MANIFEST} (missing part)")
    optimizer_state = load_state(path / OPTIMIZER_FILE) if OPTIMIZER_FILE in files else None
    saved_world = trainer_state.world_size
    rng_state = None  # a rank the checkpoint was not written by: derive its state (derived_rng_state)
    if rank < saved_world:
        name = rng_file(rank)
        if name not in files:
            raise ManifestError(f"{path}: {name!r} is not listed in the manifest (missing part)")
        rng_state = load_state(path / name)
    if restore_rng and rng_state is not None:
        restore_rng_state(rng_state)
    return LoadedCheckpoint(
        path=path,
        trainer_state=trainer_state,
        model_state=None if sharded or adapter else load_weights(path, verify=False),
        optimizer_state=optimizer_state,
        rng_state=rng_state,
        shards=path / SHARDS_DIR if sharded else None,
        adapter_state=load_adapter(path / ADAPTER_DIR) if adapter else None,
    )


def resolve_resume(
    resume: str | None, ckpt_dir: str | os.PathLike, *, say: Callable[[str], None] | None = None
) -> Path | None:
    """``--resume``: None/'none' -> None; a path -> that checkpoint (it must verify); 'auto' -> the newest
    checkpoint that verifies (sizes and checksums), falling back past bad ones with a message through ``say``.

    'auto' returns None only when no directory under a checkpoint name exists; when some exist and none
    verifies it raises ManifestError listing why (a run never silently starts over on top of checkpoints)."""
    if resume is None or resume == "none":
        return None
    if resume != "auto":
        p = Path(resume)
        if not p.is_dir() or not STEP_RE.match(p.name):
            raise ValueError(f"--resume: {resume!r} is not a checkpoint directory (step_NNNNNN)")
        try:
            verify_checkpoint(p)
        except CheckpointFormatError:
            raise
        except ManifestError as exc:
            raise ValueError(f"--resume: {resume!r} is not a complete, intact checkpoint: {exc}") from None
        return p
    rejected: list[str] = []
    for cand in reversed(_step_dirs(Path(ckpt_dir))):
        try:
            verify_checkpoint(cand)
        except CheckpointFormatError:
            raise  # never fall back past a newer checkpoint to an older one
        except ManifestError as exc:
            rejected.append(str(exc))
            continue
        if rejected and say is not None:
            say(f"[resume] skipped {len(rejected)} checkpoint(s) that failed verification: {'; '.join(rejected)}")
            say(f"[resume] falling back to {cand}")
        return cand
    if rejected:
        raise ManifestError(
            f"--resume auto: no checkpoint under {ckpt_dir} verifies ({'; '.join(rejected)}); refusing to start "
            "over on top of them: resume from a checkpoint path, repair or move the folder, or choose another "
            "output_dir"
        )
    return None
