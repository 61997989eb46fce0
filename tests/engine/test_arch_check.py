"""A checkpoint of another architecture is refused before any model is built, naming the first mismatching parameter
and both shapes (``alignopsd eval --checkpoint``, and a resume with ``--allow-config-change``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.trainer_state import TrainerState
from alignopsd.engine.config.arch_check import (
    ArchitectureMismatchError,
    check_architecture,
    first_mismatch,
    safetensors_shapes,
)
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.run.resume import stored_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
GATE = "model.layers.0.mlp.gate_proj.weight"


def _tiny_shapes(intermediate: int = 128) -> dict[str, tuple[int, ...]]:
    """State-dict shapes of the tiny model (configs/tiny.yaml's model.name) with another MLP width when asked."""
    from alignopsd.engine.models.loading import tiny_config
    from transformers import LlamaForCausalLM

    cfg = tiny_config()
    cfg.intermediate_size = intermediate
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _checkpoint(out: Path, shapes: dict, overrides: list[str] = ()) -> Path:
    cfg = load_config(TINY, [f"output_dir={out}", *overrides])
    state = {k: torch.zeros(s) for k, s in shapes.items() if k != "lm_head.weight"}  # tied: left out
    return ck.save_checkpoint(out / "checkpoints", 2, model_state=state, optimizer_state=None,
                              trainer_state=TrainerState(2, run_config=stored_config(cfg)))  # fmt: skip


def test_shapes_come_from_the_header_and_the_first_difference_is_named(tmp_path):
    path = _checkpoint(tmp_path, _tiny_shapes(256))
    saved = safetensors_shapes(path / "model.safetensors")
    assert saved[GATE] == (256, 64) and "lm_head.weight" not in saved
    check_architecture(_checkpoint(tmp_path / "ok", _tiny_shapes()), "tiny")  # fits (tied head absent is fine)
    with pytest.raises(ArchitectureMismatchError) as err:
        check_architecture(path, "tiny")
    assert f"parameter '{GATE}' has shape [256, 64] in the checkpoint and [128, 64] in the configured model" in str(
        err.value
    )
    expected = {"a": (2,), "b": (3,)}
    assert first_mismatch({"a": (2,)}, expected) == "parameter 'b' (shape [3] in the configured model) is missing " \
        "from the checkpoint"  # fmt: skip
    assert "parameter 'c' (shape [1]) of the checkpoint is not in" in first_mismatch({**expected, "c": (1,)}, expected)
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_shapes(tmp_path / "bad.safetensors")


_DRIVER = """
import contextlib, io, json, sys
from alignopsd.engine.run import trainer as train
from alignopsd.engine.{module} import main
built = []
def no_build(self, *a, **k):
    built.append(1)
    raise SystemExit("a model was built")
train.Trainer.__init__ = no_build
err = io.StringIO()
with contextlib.redirect_stderr(err):
    rc = main(json.loads(sys.argv[1]))
print(json.dumps({{"rc": rc, "stderr": err.getvalue(), "built": bool(built)}}))
"""


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_commands_refuse_another_architecture_before_building_the_model(tmp_path, command):
    if command == "eval":
        path = _checkpoint(tmp_path, _tiny_shapes(256))
        module, args = "commands.evaluate", ["--config", TINY, "--checkpoint", str(path)]
        head = f"--checkpoint {path} does not fit the configured model 'tiny'"
    else:  # a checkpoint of another run config (another learning rate) and another MLP width, resumed with the override
        path = _checkpoint(tmp_path, _tiny_shapes(256), ["trainer.optimizer.lr=0.01"])
        module = "commands.train"
        args = ["--config", TINY, "--set", f"output_dir={tmp_path}", "--resume", "auto", "--allow-config-change"]
        head = f"--resume: checkpoint {path} does not fit the configured model 'tiny'"
    r = subprocess.run([sys.executable, "-c", _DRIVER.format(module=module), json.dumps(args)], capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["rc"] == 2 and not res["built"], res
    assert head in res["stderr"] and "'model.layers.0.mlp.gate_proj.weight' has shape [256, 64] in the checkpoint " \
        "and [128, 64]" in res["stderr"], res  # fmt: skip
    assert "Traceback" not in res["stderr"] and len(res["stderr"].strip().splitlines()) == 1, res
