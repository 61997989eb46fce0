"""Reading an offline W&B run back, for the logger tests.

wandb 0.31 writes an offline run as ``<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``: the transaction log its
service (wandb-core) also syncs from, in LevelDB's log format (32 KiB blocks of records, each a 7-byte header:
CRC-32C, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte file header (``:W&B``, magic 0xBEE1, version 0). Each
record is a ``wandb.proto.wandb_internal_pb2.Record``, the library's own protobuf. The Python package no longer ships
a reader of this file (the old ``wandb.sdk.internal.datastore`` moved into the Go service), so the framing is read
here and every record is decoded with wandb's protobuf classes.

:func:`attempts` returns the records of each attempt (folder) of a run, oldest first; :func:`live_history` replays them
as ``wandb sync`` hands them to the server: an attempt started with ``resume_from`` (its run record's
``branch_point``) drops the rows after that step before its own rows come.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[pb.Record]:
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending = [], HEADER.size, b""
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = RECORD.unpack_from(data, pos)
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + RECORD.size : pos + RECORD.size + length]
        pos += RECORD.size + length
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def attempts(wandb_dir: Path, run_id: str) -> list[list[pb.Record]]:
    """The records of every offline attempt of ``run_id`` under ``wandb_dir`` (the folder holding ``wandb/``)."""
    folders = sorted((Path(wandb_dir) / "wandb").glob(f"offline-run-*-{run_id}"))
    return [records(f / f"run-{run_id}.wandb") for f in folders]


def _value(item) -> object:
    return json.loads(item.value_json)


def history_rows(recs: list[pb.Record]) -> dict[int, dict[str, object]]:
    """``{step: {metric: value}}`` of one attempt (wandb's own ``_``-keys left out)."""
    rows: dict[int, dict[str, object]] = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): _value(i) for i in r.history.item}
            rows.setdefault(int(items["_step"]), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def branch_point(recs: list[pb.Record]) -> tuple[str, int] | None:
    """(run id, step) of an attempt started with ``resume_from``; None for a fresh run."""
    for r in recs:
        if r.WhichOneof("record_type") == "run" and r.run.HasField("branch_point"):
            return r.run.branch_point.run, int(r.run.branch_point.value)
    return None


def live_history(wandb_dir: Path, run_id: str) -> dict[int, dict[str, object]]:
    """The run's history after every attempt is synced in order (a rewind drops the rows after its step)."""
    rows: dict[int, dict[str, object]] = {}
    for recs in attempts(wandb_dir, run_id):
        bp = branch_point(recs)
        if bp is not None:
            rows = {s: r for s, r in rows.items() if s <= bp[1]}
        for step, row in history_rows(recs).items():
            rows.setdefault(step, {}).update(row)
    return rows


def config_of(recs: list[pb.Record]) -> dict[str, object]:
    """The config the attempt logged (its run record's and config records' items, ``_wandb`` left out)."""
    out: dict[str, object] = {}
    for r in recs:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        out.update({i.key: _value(i) for i in items if i.key != "_wandb"})
    return out


def summary_of(recs: list[pb.Record]) -> dict[str, object]:
    out: dict[str, object] = {}
    for r in recs:
        if r.WhichOneof("record_type") == "summary":
            out.update({(i.key or "/".join(i.nested_key)): _value(i) for i in r.summary.update})
    return out


def artifacts_of(recs: list[pb.Record]) -> list[tuple[str, str, list[str]]]:
    """(name, type, file paths of its manifest) of every artifact the attempt logged."""
    out = []
    for r in recs:
        if r.WhichOneof("record_type") == "artifact":
            a = r.artifact
            out.append((a.name, a.type, sorted(e.path for e in a.manifest.contents)))
    return out
