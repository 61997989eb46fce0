"""The checkpoint format: typed trainer state and load result, ``format_version`` in the manifest; checkpoints of
the project's first format (no ``format_version``; committed under tests/assets/checkpoint_v1, written by that
format's code) still load and resume, and a checkpoint of a newer format is refused naming both versions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.trainer_state import (
    FIRST_FORMAT,
    FORMAT_VERSION,
    CheckpointFormatError,
    TrainerState,
    format_version,
    read_trainer_state,
)
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.run.resume import check_resume

ROOT = Path(__file__).resolve().parents[2]
V1 = ROOT / "tests" / "assets" / "checkpoint_v1" / "step_000002"
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_a_first_format_checkpoint_loads():
    assert format_version(V1) == FIRST_FORMAT
    got = ck.load_checkpoint(V1, restore_rng=False)
    assert torch.equal(got.model_state["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(got.optimizer_state["state"][0]["exp_avg"], torch.full((2, 3), 0.5))
    assert got.trainer_state.step == 2 and got.trainer_state.data_position["step"] == 2
    assert got.trainer_state.span_lengths_count == 0 and got.trainer_state.world_size == 1
    assert got.rng_state is not None and got.shards is None and got.path == V1


def test_a_first_format_checkpoint_resumes_its_config():
    """Only the keys added since that divide the same work another way (micro-batches by tokens, packed rows)
    differ: shown, not refused; set to what the checkpoint ran with, nothing differs (a key added since that changes
    nothing at its default, trainer.checkpoint.save_every_s, is no change)."""
    cfg = load_config(TINY, [])
    assert check_resume(V1, cfg) == [
        "trainer.ppo.activation_memory_gib: (absent) -> 'auto' (the same objective divided another way; sums may round "
        "differently)",
        "trainer.ppo.max_token_len_per_gpu: (absent) -> 'auto' (the same objective divided another way; sums may "
        "round differently)",
        "trainer.ppo.use_remove_padding: (absent) -> 'auto' (the same objective divided another way; sums may round "
        "differently)",
    ]
    as_then = [
        "trainer.ppo.max_token_len_per_gpu=0",
        "trainer.ppo.use_remove_padding=false",
        "trainer.ppo.activation_memory_gib=null",
    ]
    assert check_resume(V1, load_config(TINY, as_then)) == []


def test_the_files_are_those_of_the_first_format_and_the_manifest_says_the_version(tmp_path):
    """Saved again from its typed trainer state, the first-format checkpoint's trainer_state.json comes out byte
    for byte; only the manifest gains ``format_version``."""
    old = ck.load_checkpoint(V1, restore_rng=False)
    new = ck.save_checkpoint(tmp_path, 2, model_state=old.model_state, optimizer_state=old.optimizer_state,
                             trainer_state=old.trainer_state)  # fmt: skip
    assert (new / "trainer_state.json").read_bytes() == (V1 / "trainer_state.json").read_bytes()
    assert read_trainer_state(new) == old.trainer_state
    body, v1_body = (json.loads((p / "manifest.json").read_text()) for p in (new, V1))
    assert body.pop("format_version") == FORMAT_VERSION == format_version(new)
    assert body.keys() == v1_body.keys() and body["files"].keys() == v1_body["files"].keys()
    with pytest.raises(ValueError, match=r"trainer_state.step: 3 is not the step saved \(2\)"):
        ck.save_checkpoint(tmp_path, 2, model_state=old.model_state, optimizer_state=None,
                           trainer_state=TrainerState(3))  # fmt: skip


def _newer(tmp_path: Path, step: int = 2) -> Path:
    """A copy of the first-format checkpoint whose manifest says a format newer than this code's."""
    path = tmp_path / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(V1, path)
    body = json.loads((path / "manifest.json").read_text())
    body["format_version"] = FORMAT_VERSION + 1
    (path / "manifest.json").write_text(json.dumps(body))
    return path


def test_a_newer_format_is_refused_naming_both_versions(tmp_path):
    path = _newer(tmp_path)
    shutil.copytree(V1, tmp_path / "checkpoints" / "step_000001")  # an older, valid step: no fallback to it
    both = rf"format_version {FORMAT_VERSION + 1} is newer .*format_version {FORMAT_VERSION}\)"
    for call in (
        lambda: ck.load_checkpoint(path, restore_rng=False),
        lambda: read_trainer_state(path),
        lambda: ck.resolve_resume(str(path), tmp_path / "checkpoints"),
        lambda: ck.resolve_resume("auto", tmp_path / "checkpoints"),
    ):
        with pytest.raises(CheckpointFormatError, match=both):
            call()


@pytest.mark.parametrize("command", ["train", "eval"])
def test_the_commands_exit_2_on_a_newer_format(tmp_path, capsys, command):
    from alignopsd.engine.commands.cli import main

    path = _newer(tmp_path)
    flag = ["--resume", str(path)] if command == "train" else ["--checkpoint", str(path)]
    assert main([command, "--config", TINY, "--set", f"output_dir={tmp_path}", *flag]) == 2
    err = capsys.readouterr().err
    assert f"format_version {FORMAT_VERSION + 1} is newer" in err and f"(format_version {FORMAT_VERSION})" in err


def test_the_rows_choice_is_a_typed_record_and_older_checkpoints_map_theirs(tmp_path):
    """``TrainerState.rows`` (packed or padded rows, as measured) round-trips as a typed record; a checkpoint written
    before it kept the choice among the kernels' ``paths`` ("packed rows"), which reads back as ``rows`` and leaves
    the kernels' own; a damaged record is refused naming the field."""
    from alignopsd.engine.checkpoint.manifest import ManifestError, write_manifest
    from alignopsd.engine.checkpoint.trainer_state import (
        STATE_FILE,
        RowsChoice,
        TrainerState,
        read_trainer_state,
        write_trainer_state,
    )

    (tmp_path / "x.bin").write_bytes(b"x")
    write_manifest(tmp_path)
    chose = RowsChoice(False, 8.9, 3.9, "the first 2 micro-batches of the update (24 rows), forward and backward")
    write_trainer_state(tmp_path, TrainerState(3, paths={"head partials": False}, rows=chose))
    back = read_trainer_state(tmp_path)
    assert back.rows == chose and back.paths == {"head partials": False}
    assert chose.describe().startswith("packed rows: padded rows (3.9 s) over packed rows (8.9 s) at the first 2")
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 3, "paths": {"packed rows": True, "head partials": True}}))
    old = read_trainer_state(tmp_path)
    assert old.rows == RowsChoice(True) and old.paths == {"head partials": True}
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 3, "paths": {"packed rows": False}}))
    assert read_trainer_state(tmp_path).rows == RowsChoice(False) and read_trainer_state(tmp_path).paths is None
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 3, "rows": {"packed": "yes"}}))
    with pytest.raises(ManifestError, match="'rows'.*'packed' must be true or false"):
        read_trainer_state(tmp_path)
