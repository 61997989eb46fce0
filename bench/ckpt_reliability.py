"""Checkpoint reliability cases (issue 25 items 2, 5, 8, 9), each run as a user would, printed as a Markdown table.

    python bench/ckpt_reliability.py [--timeout 60] [--only NAME,...] > table.md

Every case runs the real command (``python -m alignopsd.engine train|eval`` on configs/tiny.yaml, or the train
command line with the guess environment, tests/engine/sharded_run.py) in a fresh folder under a time limit and
reports: exit status, seconds, whether a traceback was printed, the first error line, and for the forged index
whether its code ran (a marker file). Cases that need root (a 2 MiB tmpfs for ENOSPC) are skipped without it.
The same script runs against an older checkout to fill the "before" column.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(ROOT / "tests" / "engine" / "sharded_run.py")
GUESS = ["env.name=guess", "env.max_turns=2", "env.history_length=1", "env.group_n=4", "env.tasks_per_step=4",
         "env.num_games=8", "algorithm.kl_coef=0.0", "trainer.total_steps=1"]  # fmt: skip
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _sets(items: list[str]) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


def _run(cmd: list[str], timeout: float, preexec=None) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec, env=ENV)
    except subprocess.TimeoutExpired:
        return {"rc": "hang", "s": time.perf_counter() - t0, "tb": False, "line": f"killed after {timeout:.0f} s"}
    err = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith(("INFO", "WARNING", "Loading", "Writ"))]
    first = next((x for x in err if "error" in x.lower()), err[-1] if err else "")
    if "Traceback" in r.stderr and err:  # the exception itself, not a line of the traceback
        first = err[-1]
    return {"rc": r.returncode, "s": time.perf_counter() - t0, "tb": "Traceback" in r.stderr, "line": first[:160]}


def _limit(nbytes: int, ignore_sigxfsz: bool):
    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN if ignore_sigxfsz else signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return pre


def _checkpoint(out: Path, shapes_mlp: int | None = None, sharded: bool = False, overrides=()) -> Path:
    """A trainer checkpoint of configs/tiny.yaml's run (stand-in or tiny-shaped weights; DCP shards if sharded)."""
    import torch
    from alignopsd.engine.checkpoint import checkpoint as ck
    from alignopsd.engine.checkpoint.manifest import write_manifest
    from alignopsd.engine.checkpoint.trainer_state import TrainerState
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.resume import stored_config

    cfg = load_config(TINY, [f"output_dir={out}", *overrides])
    state = {"w": torch.zeros(2)}
    if shapes_mlp is not None:
        from alignopsd.engine.models.loading import tiny_config
        from transformers import LlamaForCausalLM

        hf = tiny_config()
        hf.intermediate_size = shapes_mlp
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in LlamaForCausalLM(hf).state_dict().items() if k != "lm_head.weight"}
        state = {k: torch.zeros(s) for k, s in shapes.items()}

    def shards(folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.arange(6.0), "steps": 3}, checkpoint_id=str(folder), no_dist=True)
        write_manifest(folder)

    return ck.save_checkpoint(
        out / "checkpoints",
        2,
        model_state=None if sharded else state,
        optimizer_state=None,
        trainer_state=TrainerState(2, run_config=stored_config(cfg)),
        shards=shards if sharded else None,
        shard_state={"w": torch.zeros(2)} if sharded else None,
    )


def _relist(path: Path, rel: str, entry: dict) -> None:
    body = json.loads((path / "manifest.json").read_text())
    body["files"][rel] = entry
    (path / "manifest.json").write_text(json.dumps(body))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def hostile(kind: str, command: str, d: Path, timeout: float) -> dict:
    from alignopsd.engine.checkpoint.manifest import write_manifest

    path = _checkpoint(d)
    if kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path / "extra.bin")
        _relist(path, "extra.bin", {"size": 0, "crc32": "00000000"})
    elif kind == "FIFO":
        os.mkfifo(path / "extra.bin")
        _relist(path, "extra.bin", {"size": 0, "crc32": "00000000"})
    elif kind == "'..' entry":
        (d / "checkpoints" / "outside.bin").write_bytes(b"x")
        _relist(path, "../outside.bin", {"size": 1, "crc32": "8cdc1683"})
    else:  # step "two", manifest recomputed
        state = json.loads((path / "trainer_state.json").read_text())
        state["step"] = "two"
        (path / "trainer_state.json").write_text(json.dumps(state))
        write_manifest(path)
    if command == "train":
        cmd = ["train", "--config", TINY, "--set", f"output_dir={d}", "--resume", "auto"]
    else:
        cmd = ["eval", "--config", TINY, "--checkpoint", str(path)]
    return _run([sys.executable, "-m", "alignopsd.engine", *cmd], timeout)


def forged_index(d: Path, timeout: float) -> dict:
    """The sharded index replaced by a pickle whose __reduce__ runs a command, both manifests recomputed; then
    ``--resume auto`` (command line) and the Megatron backend's sharded read of the folder (in a child process)."""
    from alignopsd.engine.checkpoint.manifest import write_manifest

    path = _checkpoint(d, sharded=True)
    marker = d / "pwned"
    (path / "shards" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    write_manifest(path / "shards")
    write_manifest(path)
    res = _run(
        [
            sys.executable,
            "-m",
            "alignopsd.engine",
            "train",
            "--config",
            TINY,
            "--set",
            f"output_dir={d}",
            "--resume",
            "auto",
        ],
        timeout,
    )
    backend = (
        "import sys, torch\n"
        "from alignopsd.engine.policy.megatron import backend as b\n"
        "src = open(b.__file__).read()\n"
        "state = {'w': torch.zeros(6), 'steps': 0}\n"
        "if 'safe_dcp.load' in src:\n"
        "    from alignopsd.engine.checkpoint import safe_dcp; safe_dcp.load(state, sys.argv[1], {'__0_0.distcp'})\n"
        "else:\n"
        "    import torch.distributed.checkpoint as dcp; dcp.load(state, checkpoint_id=sys.argv[1])\n"
    )
    res2 = _run([sys.executable, "-c", backend, str(path / "shards")], timeout)
    res["line"] = f"resume: {res['line']} / backend read: rc {res2['rc']}, {res2['line']}"
    res["marker"] = marker.exists()
    return res


def arch(command: str, d: Path, timeout: float) -> dict:
    if command == "eval":
        path = _checkpoint(d, shapes_mlp=256)
        cmd = ["eval", "--config", TINY, "--checkpoint", str(path)]
    else:
        _checkpoint(d, shapes_mlp=256, overrides=["trainer.optimizer.lr=0.01"])
        cmd = ["train", "--config", TINY, "--set", f"output_dir={d}", "--resume", "auto", "--allow-config-change"]
    return _run([sys.executable, "-m", "alignopsd.engine", *cmd], timeout)


def save_past_limit(d: Path, timeout: float, ignore_sigxfsz: bool) -> dict:
    cmd = [sys.executable, RUNNER, "--config", TINY, *_sets(GUESS), "--output-dir", str(d)]
    res = _run(cmd, timeout, preexec=_limit(2 << 20, ignore_sigxfsz))
    left = sorted(p.name for p in (d / "checkpoints").iterdir()) if (d / "checkpoints").is_dir() else []
    res["line"] += f" | left in checkpoints/: {left}"
    return res


def full_disk(d: Path, timeout: float) -> dict:
    """A 2 MiB tmpfs as the checkpoint folder's file system (ENOSPC); needs root."""
    mnt = d / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        return {"rc": "skipped", "s": 0.0, "tb": False, "line": "no permission to mount a tmpfs"}
    try:
        code = (
            "import sys, torch\nfrom alignopsd.engine.checkpoint import checkpoint as ck\n"
            "ck.save_checkpoint(sys.argv[1], 1, model_state={'w': torch.zeros(1 << 20)},\n"
            "                   optimizer_state=None)\n"
        )
        res = _run([sys.executable, "-c", code, str(mnt / "checkpoints")], timeout)
        res["line"] += f" | left: {sorted(p.name for p in (mnt / 'checkpoints').iterdir())}"
        return res
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def leftover(d: Path, timeout: float) -> dict:
    code = (
        "import sys, torch, pathlib\nfrom alignopsd.engine.checkpoint import checkpoint as ck\n"
        "d = pathlib.Path(sys.argv[1]); (d / '.tmp-step_000001').mkdir(parents=True)\n"
        "(d / '.tmp-step_000001' / 'model.safetensors').write_bytes(b'half')\n"
        "ck.save_checkpoint(d, 2, model_state={'w': torch.zeros(2)}, optimizer_state=None)\n"
        "print(sorted(p.name for p in d.iterdir()), ck.resolve_resume('auto', d).name)\n"
    )
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", code, str(d / "checkpoints")], capture_output=True, text=True, timeout=timeout, env=ENV
    )
    return {
        "rc": r.returncode,
        "s": time.perf_counter() - t0,
        "tb": "Traceback" in r.stderr,
        "line": (r.stdout.strip() or r.stderr.strip().splitlines()[-1])[:160],
    }


def cases(timeout: float):
    yield "2 write", "save past `ulimit -f` 2 MiB, SIGXFSZ ignored (EFBIG)", lambda d: save_past_limit(d, 600, True)
    yield "2 write", "save past `ulimit -f` 2 MiB, SIGXFSZ default", lambda d: save_past_limit(d, 600, False)
    yield "2 write", "save on a full 2 MiB tmpfs (ENOSPC)", lambda d: full_disk(d, timeout)
    yield "2 write", "next save after a kill left `.tmp-step_000001`", lambda d: leftover(d, timeout)
    for kind in ("symlink to /dev/zero", "FIFO", "'..' entry", 'trainer_state step "two"'):
        for command in ("train", "eval"):
            name = "train --resume auto" if command == "train" else "eval --checkpoint"
            yield "5 hostile files", f"{kind}: {name}", lambda d, k=kind, c=command: hostile(k, c, d, timeout)
    yield "8 forged index", "`shards/.metadata` runs `touch`, manifests recomputed", lambda d: forged_index(d, timeout)
    yield "9 architecture", "eval --checkpoint of MLP width 256 (model: 128)", lambda d: arch("eval", d, 300)
    yield "9 architecture", "train --resume auto --allow-config-change, same", lambda d: arch("train", d, 300)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as hanging")
    p.add_argument("--only", default="", help="comma-separated substrings of case names to run")
    args = p.parse_args()
    print("| item | case | exit | seconds | traceback | first error line |")
    print("|---|---|---|---:|---|---|")
    for item, name, fn in cases(args.timeout):
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        d = Path(tempfile.mkdtemp(prefix="ckrel-"))
        try:
            res = fn(d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        extra = f" (code ran: {res['marker']})" if "marker" in res else ""
        line = res["line"].replace("|", "\\|")
        print(
            f"| {item} | {name} | {res['rc']} | {res['s']:.1f} | {'yes' if res['tb'] else 'no'} | {line}{extra} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
