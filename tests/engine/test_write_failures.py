"""Write failures (a real file size limit, RLIMIT_FSIZE, in a child process): one message naming the file and the
cause, the last complete checkpoint untouched, unfinished folders removed by the next save and never resumed."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.infra.writes import WriteFailure

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))  # the train command line with the guess environment

_LIMITED = """
import resource, sys
from alignopsd.engine.infra.writes import WriteFailure
def limit(n):
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
d = sys.argv[1]
try:
{body}
except WriteFailure as exc:
    print(exc)
    sys.exit(3)
"""


def _run_limited(body: str, folder: Path) -> subprocess.CompletedProcess:
    code = _LIMITED.format(body="\n".join("    " + line for line in body.strip().splitlines()))
    return subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120)


def test_a_save_past_the_size_limit_names_the_file_and_keeps_the_last_checkpoint(tmp_path):
    r = _run_limited(
        """
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
ck.save_checkpoint(d, 1, model_state={"w": torch.zeros(16)}, optimizer_state=None)
limit(64 << 10)
ck.save_checkpoint(d, 2, model_state={"w": torch.zeros(100_000)}, optimizer_state=None)
""",
        tmp_path,
    )
    assert r.returncode == 3, r.stderr
    msg = r.stdout.strip()
    assert msg.startswith(f"cannot write {tmp_path}/.tmp-step_000002/model.safetensors: File too large (EFBIG)"), msg
    assert "checkpoint of step 2 not saved; the last complete checkpoint" in msg and "step_000001 is untouched" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # the unfinished folder is gone
    ck.verify_checkpoint(tmp_path / "step_000001")
    assert ck.resolve_resume("auto", tmp_path) == tmp_path / "step_000001"


@pytest.mark.parametrize(("opt_numel", "text", "name"), [(8000, 10, "optimizer.safetensors"),
                                                         (10, 30000, "trainer_state.json")])  # fmt: skip
def test_every_file_of_a_save_is_guarded(tmp_path, opt_numel, text, name):
    r = _run_limited(
        f"""
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.trainer_state import TrainerState
opt = {{"m": torch.zeros({opt_numel}), "step": 3}}
limit(20000)
state = TrainerState(1, config_name="y" * {text})
ck.save_checkpoint(d, 1, model_state={{"w": torch.zeros(8)}}, optimizer_state=opt, trainer_state=state)
""",
        tmp_path,
    )
    assert r.returncode == 3, r.stderr
    assert f".tmp-step_000001/{name}: File too large (EFBIG)" in r.stdout and "no complete checkpoint" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_metrics_audit_and_side_files_past_the_limit(tmp_path):
    r = _run_limited(
        """
from pathlib import Path
from alignopsd.engine.observe.metrics import MetricsLogger
log = MetricsLogger(d, total_steps=10, stream=open("/dev/null", "w"))
limit(1000)
for step in range(1, 100):
    log.log(step, {"actor/loss": 0.5, "text": 1.0})
""",
        tmp_path / "m",
    )
    assert r.returncode == 3 and r.stdout.strip() == f"cannot write {tmp_path}/m/metrics.jsonl: File too large (EFBIG)"
    r = _run_limited(
        """
from alignopsd.engine.observe.audit import Auditor
a = Auditor(d, total_steps=10)
limit(1000)
a.write(1, [{"kind": "turn", "text": "x" * 5000}])
""",
        tmp_path / "a",
    )
    assert r.returncode == 3 and "audit/step_000001.rank0.jsonl: File too large (EFBIG)" in r.stdout, r.stderr
    assert list((tmp_path / "a" / "audit").iterdir()) == []  # no half-written temporary file
    r = _run_limited(
        """
from pathlib import Path
from alignopsd.engine.checkpoint.manifest import atomic_write_bytes
Path(d).mkdir()
limit(1000)
atomic_write_bytes(Path(d) / "span_lengths.json", b"[1]" * 1000)
""",
        tmp_path / "s",
    )
    assert r.returncode == 3
    assert r.stdout.strip() == f"cannot write {tmp_path}/s/span_lengths.json: File too large (EFBIG)"
    assert list((tmp_path / "s").iterdir()) == []


def test_warm_start_output_past_the_limit(tmp_path):
    r = _run_limited(
        """
from transformers import LlamaConfig, LlamaForCausalLM
from alignopsd.engine.policy.hf import HFPolicy
from alignopsd.engine.run.warm_start import save_warm_start
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
limit(4096)
save_warm_start(HFPolicy(model), None, d, base="tiny", meta={})
""",
        tmp_path / "sft",
    )
    assert r.returncode == 3, r.stderr
    msg = r.stdout.strip()  # written beside the output folder first (engine/checkpoint/weights.py), removed on failure
    assert msg.startswith(f"cannot write {tmp_path}/.sft.tmp-") and "/model.safetensors: File too large (EFBIG)" in msg
    assert not (tmp_path / "sft").exists() and not list(tmp_path.glob(".sft.tmp-*"))


def test_a_full_disk_names_the_file(tmp_path):
    """A 2 MiB tmpfs (ENOSPC); mounting one needs root, the test is skipped without it."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("no permission to mount a tmpfs")
    try:
        first = ck.save_checkpoint(mnt, 1, model_state={"w": torch.zeros(8)}, optimizer_state=None)
        with pytest.raises(WriteFailure) as err:
            ck.save_checkpoint(mnt, 2, model_state={"w": torch.zeros(1 << 20)}, optimizer_state=None)
        assert str(err.value).startswith(f"cannot write {mnt}/.tmp-step_000002/model.safetensors: No space left on "
                                         "device (ENOSPC); checkpoint of step 2 not saved")  # fmt: skip
        assert sorted(p.name for p in mnt.iterdir()) == ["step_000001"]
        ck.verify_checkpoint(first)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_unfinished_folders_are_removed_by_the_next_save_and_never_resumed(tmp_path):
    one = ck.save_checkpoint(tmp_path, 1, model_state={"w": torch.ones(2)}, optimizer_state=None)
    three = ck.save_checkpoint(tmp_path, 3, model_state={"w": torch.ones(2)}, optimizer_state=None)
    shutil.copytree(three, tmp_path / ".tmp-step_000009")  # complete and verifiable, but under an unfinished name
    (tmp_path / ".tmp-step_000004").mkdir()
    (tmp_path / ".tmp-step_000004" / "model.safetensors").write_bytes(b"half")
    shutil.copytree(one, tmp_path / ".old-step_000001")  # a re-save's old copy; the step is there: removed
    three.rename(tmp_path / ".old-step_000003")  # a re-save killed between its renames: the only copy of step 3
    assert ck.resolve_resume("auto", tmp_path) == one  # neither unfinished nor old folders are resumed
    ck.save_checkpoint(tmp_path, 5, model_state={"w": torch.ones(2)}, optimizer_state=None,
                       keep_last=5)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000003", "step_000005"]
    ck.verify_checkpoint(tmp_path / "step_000003")


def _no_sigxfsz_ignored():
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as a shell leaves it: the interpreter ignores it at start
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.slow
def test_train_command_past_the_size_limit_exits_1_with_one_message(tmp_path):
    """``alignopsd train`` under ``ulimit -f`` (2 MiB; the tiny model's weights are 12 MiB): the step runs, its
    metrics are written, the checkpoint is not: exit status 1, one line naming the file and the cause."""
    args = ["--config", TINY, *[a for o in [*lh.GUESS_OVERRIDES, "trainer.total_steps=1"] for a in ("--set", o)],
            "--output-dir", str(tmp_path)]  # fmt: skip
    r = subprocess.run([sys.executable, RUNNER, *args], capture_output=True, text=True,
                       preexec_fn=_no_sigxfsz_ignored, timeout=600)  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"alignopsd train: error: cannot write {tmp_path}/checkpoints/.tmp-step_000001/model.safetensors: File too "
        "large (EFBIG); checkpoint of step 1 not saved; there is no complete checkpoint"
    ], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert list((tmp_path / "checkpoints").iterdir()) == []
