"""Hostile checkpoint files: manifest entries that are symlinks, FIFOs, devices or paths outside the folder, and
trainer states with wrong types, are refused at once (exit code 2 through the commands), before anything is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.manifest import ManifestError, file_entry, verify_manifest, write_manifest
from alignopsd.engine.checkpoint.trainer_state import TrainerState
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.run.resume import stored_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _checkpoint(out: Path) -> Path:
    cfg = load_config(TINY, [f"output_dir={out}"])
    return ck.save_checkpoint(out / "checkpoints", 2, model_state={"w": torch.zeros(2)}, optimizer_state=None,
                              trainer_state=TrainerState(2, run_config=stored_config(cfg)))  # fmt: skip


def _list(path: Path, rel: str, entry: dict) -> None:
    """Add an entry to the manifest, as a forger who rewrites the manifest would."""
    body = json.loads((path / "manifest.json").read_text())
    body["files"][rel] = entry
    (path / "manifest.json").write_text(json.dumps(body))


def _hostile(path: Path, kind: str) -> str:
    """Plant one hostile entry in checkpoint ``path``; returns what the refusal must say."""
    if kind == "symlink_dev_zero":
        os.symlink("/dev/zero", path / "extra.bin")
        _list(path, "extra.bin", {"size": 0, "crc32": "00000000"})
        return "'extra.bin' is a symlink"
    if kind == "fifo":
        os.mkfifo(path / "extra.bin")
        _list(path, "extra.bin", {"size": 0, "crc32": "00000000"})
        return "'extra.bin' is a FIFO"
    if kind == "dotdot":
        (path.parent / "outside.bin").write_bytes(b"x")
        _list(path, "../outside.bin", file_entry(path.parent / "outside.bin"))
        return "lists '../outside.bin', which is not a plain path inside the folder"
    if kind == "absolute":
        _list(path, "/etc/hostname", {"size": 1, "crc32": "00000000"})
        return "lists '/etc/hostname', which is not a plain path"
    if kind == "symlinked_file":  # a listed file replaced by a link to a copy of itself (same size and checksum)
        rng = path / "rng_rank0.safetensors"
        copy = path.parent / "copy.safetensors"
        copy.write_bytes(rng.read_bytes())
        rng.unlink()
        os.symlink(copy, rng)
        return "'rng_rank0.safetensors' is a symlink"
    if kind == "symlinked_dir":
        (path.parent / "elsewhere").mkdir()
        (path.parent / "elsewhere" / "a.bin").write_bytes(b"abc")
        os.symlink(path.parent / "elsewhere", path / "sub")
        _list(path, "sub/a.bin", file_entry(path.parent / "elsewhere" / "a.bin"))
        return "'sub' is a symlink, not a directory"
    state = json.loads((path / "trainer_state.json").read_text())
    state["step"] = "two"
    (path / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(path)  # the manifest recomputed to match
    return "'step' must be int >= 0, got \"two\""


KINDS = ["symlink_dev_zero", "fifo", "dotdot", "absolute", "symlinked_file", "symlinked_dir", "step_two"]


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_entries_are_refused_before_anything_is_read(tmp_path, kind):
    path = _checkpoint(tmp_path)
    match = _hostile(path, kind)
    t0 = time.perf_counter()
    with pytest.raises(ManifestError) as err:
        ck.verify_checkpoint(path)
    assert match in str(err.value)
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(ValueError, match="refusing to start over"):
        ck.resolve_resume("auto", path.parent)


def test_checksums_read_no_more_than_the_listed_size(tmp_path):
    """A file that grows between the size check and the checksum (or a forged size) is not read past its size."""
    from alignopsd.engine.checkpoint.manifest import file_crc32

    (tmp_path / "a.bin").write_bytes(b"abcdef")
    assert file_crc32(tmp_path / "a.bin", 6) == file_entry(tmp_path / "a.bin")["crc32"]
    with pytest.raises(ManifestError, match="not a regular file of 4 bytes"):
        file_crc32(tmp_path / "a.bin", 4)
    os.mkfifo(tmp_path / "p")
    with pytest.raises(ManifestError, match="not a regular file of 0 bytes"):
        file_crc32(tmp_path / "p", 0)  # opened without waiting for a writer
    os.symlink(tmp_path / "a.bin", tmp_path / "link")
    with pytest.raises(ManifestError, match="cannot be opened as a regular file"):
        file_crc32(tmp_path / "link", 6)
    (tmp_path / "d" / "sub").mkdir(parents=True)  # regular files in real subfolders verify
    (tmp_path / "d" / "sub" / "x").write_bytes(b"1")
    write_manifest(tmp_path / "d")
    assert list(verify_manifest(tmp_path / "d")) == ["sub/x"]


_DRIVER = """
import contextlib, io, json, sys, time
from alignopsd.engine.{module} import main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = main(args)
    out.append({{"rc": rc, "stderr": err.getvalue(), "seconds": time.perf_counter() - t0}})
print(json.dumps(out))
"""
COMMAND_KINDS = ["symlink_dev_zero", "fifo", "dotdot", "step_two"]


@pytest.mark.parametrize("command", ["train", "eval"])
def test_commands_refuse_hostile_checkpoints_with_exit_2(tmp_path, command):
    """``alignopsd train --resume auto`` and ``alignopsd eval --checkpoint`` on each hostile checkpoint (one process
    runs the command once per checkpoint): exit code 2 and one message, no traceback, within seconds (these cases
    hung or ended in a traceback before)."""
    calls, matches = [], []
    for kind in COMMAND_KINDS:
        out = tmp_path / kind
        path = _checkpoint(out)
        matches.append(_hostile(path, kind))
        if command == "train":
            calls.append(["--config", TINY, "--set", f"output_dir={out}", "--resume", "auto"])
        else:
            calls.append(["--config", TINY, "--checkpoint", str(path)])
    module = "commands.train" if command == "train" else "commands.evaluate"
    r = subprocess.run([sys.executable, "-c", _DRIVER.format(module=module), json.dumps(calls)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for kind, match, res in zip(COMMAND_KINDS, matches, json.loads(r.stdout.splitlines()[-1])):
        assert res["rc"] == 2, (kind, res)
        assert match in res["stderr"] and "Traceback" not in res["stderr"], (kind, res)
        assert len(res["stderr"].strip().splitlines()) == 1, (kind, res)
        assert res["seconds"] < 5.0, (kind, res)


# ---------------------------------------------------------------------------------------------------------------------
# a forged torch.distributed.checkpoint index (the Megatron backend's sharded checkpoints)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _dcp_shards(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0), "steps": 3, "hp": {"lr": 0.1, "betas": (0.9, 0.99)}}, checkpoint_id=str(folder),
             no_dist=True)  # fmt: skip
    write_manifest(folder)


def _sharded_checkpoint(out: Path) -> Path:
    cfg = load_config(TINY, [f"output_dir={out}"])
    return ck.save_checkpoint(out / "checkpoints", 2, model_state=None, optimizer_state=None,
                              trainer_state=TrainerState(2, run_config=stored_config(cfg)), shards=_dcp_shards,
                              shard_state={"w": torch.zeros(2)})  # fmt: skip


def _forge(path: Path, payload: bytes) -> None:
    """Replace the index and recompute both manifests, as a forger would."""
    (path / "shards" / ".metadata").write_bytes(payload)
    write_manifest(path / "shards")
    write_manifest(path)


def test_sharded_index_round_trip_through_the_restricted_reader(tmp_path):
    from alignopsd.engine.checkpoint import safe_dcp

    path = _sharded_checkpoint(tmp_path)
    ck.verify_checkpoint(path)
    state = {"w": torch.zeros(6), "steps": 0, "hp": {"lr": 0.0, "betas": (0.0, 0.0)}}
    safe_dcp.load(state, path / "shards", {"__0_0.distcp"})
    assert torch.equal(state["w"], torch.arange(6.0)) and state["steps"] == 3 and state["hp"]["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("forgery", ["reduce", "outside"])
def test_forged_sharded_index_runs_nothing(tmp_path, forgery):
    import pickle

    from alignopsd.engine.checkpoint import safe_dcp

    path = _sharded_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    if forgery == "reduce":
        _forge(path, pickle.dumps(_Evil(marker)))
        match = "names posix.system, which is not a torch.distributed.checkpoint metadata type"
    else:  # genuine types, but a shard entry naming a file outside the folder
        md = safe_dcp.read_metadata(path / "shards")
        for info in md.storage_data.values():
            info.relative_path = "../../trainer_state.json"
        _forge(path, pickle.dumps(md))
        match = "names '../../trainer_state.json', not a listed shard file"
    with pytest.raises(safe_dcp.UnsafeCheckpointError, match=match):
        ck.verify_checkpoint(path)
    with pytest.raises(safe_dcp.UnsafeCheckpointError, match=match):  # the backend's load path
        safe_dcp.load({"w": torch.zeros(6)}, path / "shards", {"__0_0.distcp"})
    r = subprocess.run([sys.executable, "-c", _DRIVER.format(module="commands.train"),
                        json.dumps([["--config", TINY, "--set", f"output_dir={tmp_path}", "--resume", "auto"]])],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    res = json.loads(r.stdout.splitlines()[-1])[0]
    assert res["rc"] == 2 and match in res["stderr"] and "Traceback" not in res["stderr"], res
    assert not marker.exists()


def test_non_tensor_values_of_shards_are_read_without_code(tmp_path):
    """The stock planner reads a shard's non-tensor values with torch.load(weights_only=False); ours refuses code."""
    import io
    import pickle

    from alignopsd.engine.checkpoint import safe_dcp

    marker = tmp_path / "pwned"
    planner = safe_dcp.safe_load_planner()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, io.BytesIO(pickle.dumps(_Evil(marker))))
    assert not marker.exists()
