"""The checkpoint's typed records, written and checked here and nowhere else.

- :class:`TrainerState`: ``trainer_state.json`` (step, data position, the resolved run config, the W&B / MLflow run
  ids, ...). The trainer
  builds one; :func:`write_trainer_state` writes it (the file's keys in their historical order, unset fields left
  out); :func:`read_trainer_state` reads it back with every field checked (types, ranges): a field of the wrong type
  or out of range (``"step": "two"``) is refused as a damaged checkpoint would be (ManifestError naming the file and
  the field): ``--resume auto`` falls back past it, and the commands exit with code 2.
- :class:`RowsChoice`: packed or padded rows for the policy's forwards, as the run measured them (the ``rows`` field
  of ``trainer_state.json``): a resume takes it again instead of measuring.
- :class:`LoadedCheckpoint`: what ``load_checkpoint`` (checkpoint.py) returns.
- The format's version: ``format_version`` in the checkpoint's ``manifest.json`` (:data:`FORMAT_VERSION`; a manifest
  without one is the first format, :data:`FIRST_FORMAT`, which loads as it is). A checkpoint of a newer version
  than this code's is refused before anything else of it is read (:class:`CheckpointFormatError`, naming both
  versions; the commands exit with code 2 and ``--resume auto`` does not fall back past it to an older step).

The files are verified against the manifest (sizes and checksums) before they are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignopsd.engine.checkpoint.manifest import ManifestError, manifest_field
from alignopsd.engine.infra.writes import writing

STATE_FILE = "trainer_state.json"
FIRST_FORMAT = 1  # checkpoints written before the manifest carried a format_version
FORMAT_VERSION = 2  # 2: format_version in the manifest (the files are those of version 1)


class CheckpointFormatError(ManifestError):
    """A checkpoint written by a newer version of the format than this code reads."""


PACKED_ROWS_KEY = "packed rows"  # the packing choice's key among ``paths`` in checkpoints written before ``rows``


@dataclass(frozen=True)
class RowsChoice:
    """Packed (padding-free) or padded rows for a policy's forwards on a CPU, where ``trainer.ppo.use_remove_padding``
    is auto: measured by the run's first update on its own micro-batches (engine/step/packing_trial.py), or taken again
    (a checkpoint's, rank 0's, the warm start's in the same process: ``why`` says which)."""

    packed: bool
    packed_s: float | None = None  # seconds of the timed micro-batches in packed rows (None: not measured here)
    padded_s: float | None = None  # the same micro-batches in padded rows
    measured_on: str = ""  # what was timed, e.g. "the first 2 micro-batches of the update (24 rows), forward and ..."
    why: str = ""  # how it was chosen when it was not measured here

    def describe(self) -> str:
        """One line for the run's log, e.g. ``packed rows: padded rows (3.9 s) over packed rows (8.9 s) at ...``."""
        pick, other = ("packed rows", "padded rows") if self.packed else ("padded rows", "packed rows")
        if self.packed_s is None or self.padded_s is None:
            return f"packed rows: {pick} ({self.why or 'not measured'})"
        fast, slow = (self.packed_s, self.padded_s) if self.packed else (self.padded_s, self.packed_s)
        return f"packed rows: {pick} ({fast:.1f} s) over {other} ({slow:.1f} s) at {self.measured_on}"

    def stored(self) -> dict:
        """The ``rows`` field of ``trainer_state.json``."""
        return dataclasses.asdict(self)

    @classmethod
    def of_stored(cls, value: dict, where: str = "rows") -> RowsChoice:
        """A stored choice read back, checked (ManifestError naming ``where`` and the field)."""
        if not isinstance(value.get("packed"), bool):
            raise ManifestError(f"{where}: 'packed' must be true or false, got {json.dumps(value.get('packed'))}")
        for key in ("packed_s", "padded_s"):
            v = value.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise ManifestError(f"{where}: {key!r} must be a number of seconds >= 0 or null, got {v!r}")
        return cls(
            packed=value["packed"],
            packed_s=value.get("packed_s"),
            padded_s=value.get("padded_s"),
            measured_on=str(value.get("measured_on", "")),
            why=str(value.get("why", "")),
        )


@dataclass(frozen=True)
class TrainerState:
    """``trainer_state.json``. None: not stored (a checkpoint written outside the trainer stores only the step and
    what the save adds: ``world_size``, ``sharded``, ``complete``)."""

    step: int
    data_position: dict | None = None  # where the task stream stands: {"step", "seed"}
    config_name: str | None = None
    run_config: dict | None = None  # the resolved run config (engine/run/resume.py compares a resume against it)
    span_lengths_count: int | None = None  # entries of the run's span_lengths.json that belong to this step
    world_size: int = 1  # processes that wrote the checkpoint (one RNG file each)
    sharded: bool = False  # the policy's state is in shards/ (the backend's torch.distributed.checkpoint)
    complete: bool = True
    logger_runs: dict[str, str] | None = None  # logger name -> its tracker run's id (wandb, mlflow): resumed there
    paths: dict[str, bool] | None = None  # measured CPU kernel choices (kernels/native_choice.py): taken on resume
    rows: RowsChoice | None = None  # packed or padded rows, as measured (:class:`RowsChoice`): taken on resume
    lora_base: dict[str, str] | None = None  # a LoRA checkpoint's base: {"model": model.name, "digest": of its weights}


# field -> (accepted types, lowest value or None); the file's keys are written in this order
_FIELDS: dict[str, tuple[tuple[type, ...], int | None]] = {
    "data_position": ((dict,), None),
    "config_name": ((str,), None),
    "run_config": ((dict,), None),
    "span_lengths_count": ((int,), 0),
    "step": ((int,), 0),
    "world_size": ((int,), 1),
    "sharded": ((bool,), None),
    "complete": ((bool,), None),
    "logger_runs": ((dict,), None),
    "paths": ((dict,), None),
    "rows": ((dict,), None),
    "lora_base": ((dict,), None),
}


def write_trainer_state(folder: str | os.PathLike, state: TrainerState) -> None:
    """``trainer_state.json`` of the checkpoint being written in ``folder``."""
    body = {key: getattr(state, key) for key in _FIELDS if getattr(state, key) is not None}
    if state.rows is not None:
        body["rows"] = state.rows.stored()
    with writing(Path(folder) / STATE_FILE):
        (Path(folder) / STATE_FILE).write_text(json.dumps(body, indent=2, default=str))


def format_version(folder: str | os.PathLike) -> int:
    """The checkpoint format version of ``folder`` (its manifest's ``format_version``; :data:`FIRST_FORMAT` when
    the manifest has none); CheckpointFormatError when it is newer than :data:`FORMAT_VERSION`."""
    version = manifest_field(folder, "format_version", FIRST_FORMAT)
    if not isinstance(version, int) or isinstance(version, bool) or version < FIRST_FORMAT:
        raise ManifestError(f"{folder}: format_version must be an integer >= {FIRST_FORMAT}, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{folder}: checkpoint format_version {version} is newer than this version of alignopsd reads "
            f"(format_version {FORMAT_VERSION}); load it with the version that wrote it, or a newer one"
        )
    return version


def read_trainer_state(path: str | os.PathLike) -> TrainerState:
    """``trainer_state.json`` of checkpoint ``path``, its format version and its fields checked (types, ranges);
    ManifestError naming the file and the first bad field otherwise. The caller has verified the file against the
    manifest. Keys this format does not know are left out."""
    format_version(path)
    where = Path(path) / STATE_FILE
    try:
        state = json.loads(where.read_bytes())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{where}: unreadable ({exc})") from None
    if not isinstance(state, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(state).__name__}")
    if "step" not in state:
        raise ManifestError(f"{where}: 'step' is missing")
    for key, (types, low) in _FIELDS.items():
        if key not in state:
            continue
        value = state[key]
        ok = isinstance(value, types) and (bool not in types) == (not isinstance(value, bool))
        if not ok or (low is not None and value < low):
            want = "/".join(t.__name__ for t in types) + ("" if low is None else f" >= {low}")
            raise ManifestError(f"{where}: {key!r} must be {want}, got {str(json.dumps(value))[:80]}")
    runs = state.get("logger_runs") or {}
    if not all(isinstance(k, str) and isinstance(v, str) and v for k, v in runs.items()):
        raise ManifestError(f"{where}: 'logger_runs' must map logger names to run ids, got {json.dumps(runs)[:80]}")
    base = state.get("lora_base")
    if base is not None and not (set(base) == {"model", "digest"} and all(isinstance(v, str) for v in base.values())):
        raise ManifestError(
            f'{where}: \'lora_base\' must be {{"model": str, "digest": str}}, got {json.dumps(base)[:80]}'
        )
    known = {f.name for f in dataclasses.fields(TrainerState)}
    fields = {k: v for k, v in state.items() if k in known}
    paths = dict(fields.get("paths") or {})
    if "rows" in fields:
        fields["rows"] = RowsChoice.of_stored(fields["rows"], f"{where}: 'rows'")
    elif isinstance(paths.get(PACKED_ROWS_KEY), bool):  # written before ``rows``: the choice among the kernels'
        fields["rows"] = RowsChoice(paths[PACKED_ROWS_KEY])
    if PACKED_ROWS_KEY in paths:
        del paths[PACKED_ROWS_KEY]
        fields["paths"] = paths or None
    return TrainerState(**fields)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint, read (``load_checkpoint``)."""

    path: Path
    trainer_state: TrainerState
    model_state: dict[str, Any] | None  # Hugging Face weights (None for a sharded checkpoint: see ``shards``)
    optimizer_state: dict[str, Any] | None  # rank 0's optimizer (and scheduler) state; None when not stored
    rng_state: dict[str, Any] | None  # this rank's generators (None: a rank the saving run did not have)
    shards: Path | None  # the verified sharded folder, for the backend's own load (None: not sharded)
    adapter_state: dict[str, Any] | None = None  # LoRA adapter weights in peft's layout (None: not a LoRA checkpoint)
