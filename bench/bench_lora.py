"""LoRA against the full fine-tune on the quickstart: optimizer memory, update time, held-out success.

    python -m bench.bench_lora --out bench/results/lora-<date>.md [--warm-start DIR] [--rank 16] [--lora-lr 2e-5]
        [--work runs/bench-lora]

Heavy (about 20 minutes on 2 cores): run it alone on the machine. What it does, all from one warm start:

1. the quickstart's warm start (``alignopsd sft --easy-games --config configs/quickstart_cpu.yaml --steps 60``'s
   supervised fine-tune), unless ``--warm-start`` names one already made; its held-out success;
2. the quickstart's RL (configs/quickstart_cpu.yaml: 3 AlignOPSD steps, ``Trainer.fit``) from it twice: the full
   fine-tune (the config as it is) and LoRA (``model.lora.enabled``, rank ``--rank``, alpha 2 x rank, every linear
   layer of the decoder blocks, learning rate ``--lora-lr``: LoRA's update starts at zero and is customarily run
   at about 10x the full fine-tune's rate, here 2e-5 against the quickstart's 2e-6);
3. for each: the optimizer's memory (every tensor of the optimizer state a checkpoint stores: the Adam moments,
   and the fp32 master weights a bf16 full fine-tune keeps; the fp32 gradients of every trainable parameter,
   held during the update, are counted apart), the trainable parameters, the PPO update's time per step
   (``time/update``) and the
   step's, and the held-out success of the final checkpoint (its merged weights for LoRA) on the quickstart's
   held-out games.

Both runs draw the same random stream (LoRA's initial ``lora_A`` comes from forked generators and ``lora_B`` starts
at zero), so their first step samples the same rollouts and updates on the same batch: step 1's update time is a
like-for-like comparison; later steps train on batches the two policies sampled themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.provenance import commit_line

CONFIG = "configs/quickstart_cpu.yaml"
ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """CPU model and the flags that decide the dtype and the kernels (lscpu)."""
    try:
        txt = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in txt.splitlines() if ln.startswith("Model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in txt.splitlines() if ln.startswith("Flags")), [])
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model} ({os.cpu_count()} logical CPUs), flags {' '.join(keep) or 'none of avx2/avx512/amx'}"


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts/lists."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def held_out(cfg, checkpoint: str | None) -> dict:
    from alignopsd.engine.commands.evaluate import evaluate

    t0 = time.perf_counter()
    m = evaluate(cfg, checkpoint)["metrics"]
    return {"success": m.get("episode/success_rate"), "valid": m.get("episode/valid_action_rate"),
            "seconds": time.perf_counter() - t0}  # fmt: skip


def run_arm(overrides: list[str], out: Path) -> dict:
    """The quickstart's RL from the warm start with ``overrides``; its memory, times and held-out success."""
    from alignopsd.engine.checkpoint.checkpoint import step_dir_name
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.observe.metrics import read_metrics
    from alignopsd.engine.run.trainer import Trainer

    cfg = load_config(CONFIG, [*overrides, f"output_dir={out}", "trainer.validation.after_train=false"])
    trainer = Trainer(cfg)
    policy = trainer.parts.policy
    trainable = sum(p.numel() for p in policy.params)
    try:
        trainer.fit()
        opt_bytes = tensor_bytes(policy.optimizer_state())
        grad_bytes = trainable * 4  # fp32 gradients (the masters' or the fp32 adapters'), held during the update
    finally:
        trainer.dist.close()
    recs = read_metrics(out / "metrics.jsonl")
    del trainer, policy
    ckpt = out / "checkpoints" / step_dir_name(cfg.trainer.total_steps)
    return {
        "trainable": trainable,
        "optimizer_bytes": opt_bytes,
        "grad_buffer_bytes": grad_bytes,
        "update_s": [r["time/update"] for r in recs],
        "step_s": [r["time/step"] for r in recs],
        "rows": [int(r.get("batch/rows", 0)) for r in recs],
        "heldout": held_out(cfg, str(ckpt)),
    }


def report(args, header: dict, ws: dict, arms: dict) -> str:
    mib = 2**20
    lines = [
        f"# LoRA (r = {args.rank}) against the full fine-tune on the quickstart ({header['date'][:10]})",
        "",
        f"command: `{header['command']}`",
        f"commit {header['commit']}; {header['date']}; CPU {header['cpu']}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average (1, 5, 15 min) {header['load_start']} at the start, "
        f"{header['load_end']} at the end; warm start {header['warm_start']}",
        "",
        "| | full fine-tune | LoRA |",
        "|---|---:|---:|",
    ]
    f, lo = arms["full"], arms["lora"]
    rows = [
        ("trainable parameters", f"{f['trainable']:,}", f"{lo['trainable']:,}"),
        ("optimizer state (MiB)", f"{f['optimizer_bytes'] / mib:.1f}", f"{lo['optimizer_bytes'] / mib:.1f}"),
        (
            "fp32 gradients, during the update (MiB)",
            f"{f['grad_buffer_bytes'] / mib:.1f}",
            f"{lo['grad_buffer_bytes'] / mib:.1f}",
        ),  # fmt: skip
        ("update, step 1 (same batch) (s)", f"{f['update_s'][0]:.2f}", f"{lo['update_s'][0]:.2f}"),
        ("update, mean of all steps (s)", f"{_mean(f['update_s']):.2f}", f"{_mean(lo['update_s']):.2f}"),
        ("step, mean (s)", f"{_mean(f['step_s']):.2f}", f"{_mean(lo['step_s']):.2f}"),
        ("rows per step", str(f["rows"]), str(lo["rows"])),
        ("held-out success after the RL steps", _pct(f["heldout"]["success"]), _pct(lo["heldout"]["success"])),
        ("held-out valid actions", _pct(f["heldout"]["valid"]), _pct(lo["heldout"]["valid"])),
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += [
        "",
        f"Held-out success of the warm start itself: {_pct(ws['success'])} (valid actions {_pct(ws['valid'])}).",
        f"LoRA: rank {args.rank}, alpha {2 * args.rank}, dropout 0, q/k/v/o/gate/up/down projections, lr "
        f"{args.lora_lr}; full fine-tune: the quickstart's lr. Update step ratio LoRA / full (step 1): "
        f"{lo['update_s'][0] / f['update_s'][0]:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.bench_lora", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results file (Markdown; a .json beside it)")
    p.add_argument("--warm-start", default=None, help="a quickstart warm start to reuse (default: train one)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=2e-5)
    p.add_argument("--work", default="runs/bench-lora", help="folder for the warm start and the two runs")
    args = p.parse_args(argv)
    from alignopsd.engine.commands.sft import easy_games_root, run_sft
    from alignopsd.engine.config.schema import load_config

    header = {"command": "python -m bench.bench_lora " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": commit_line(), "cpu": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_start": ", ".join(f"{x:.2f}" for x in os.getloadavg())}  # fmt: skip
    work = Path(args.work)
    base = load_config(CONFIG)
    games = [f"env.data_dir={easy_games_root(base)}"]
    ws = Path(args.warm_start) if args.warm_start else work / "sft"
    if not args.warm_start:
        run_sft(load_config(CONFIG, games), ws, steps=60, lr=1e-4, batch_size=4)  # the quickstart's warm start
    header["warm_start"] = "given" if args.warm_start else "60 steps, trained here"
    common = [*games, f"model.name={ws}"]
    ws_row = held_out(load_config(CONFIG, [*common, f"output_dir={work / 'ws-eval'}"]), None)
    lora = ["model.lora.enabled=true", f"model.lora.rank={args.rank}", f"model.lora.alpha={2.0 * args.rank}",
            f"trainer.optimizer.lr={args.lora_lr}"]  # fmt: skip
    arms = {"full": run_arm(common, work / "full"), "lora": run_arm([*common, *lora], work / "lora")}
    header["load_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(args, header, ws_row, arms))
    out.with_suffix(".json").write_text(json.dumps({"header": header, "warm_start": ws_row, "arms": arms}, indent=1))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
