"""The memory allocator against the default on the quickstart's two heavy kinds of work: sampling and the update.

    python -m bench.allocator [--rounds 3] [--steps 3] [--variants default,glibc,mimalloc]

Each variant runs the same workload in a fresh process (an allocator is chosen before a process starts), in
interleaved rounds (default, glibc, mimalloc, default, ...), so a busy machine slows every variant alike:

- the model of ``configs/quickstart_cpu.yaml`` (SmolLM2-135M) in the dtype ``model.dtype: auto`` takes on this CPU;
- per step: sampling 4 rows of a 256-token prompt for 16 new tokens with the key/value cache (the rollout's and
  the evaluations' kind of work), then one update micro-batch of 4 rows x (256 + 64) tokens through the trainer's
  fused-head PPO loss, its backward and an AdamW step (the update's and the warm start's kind of work).

It reports, per variant, the median over rounds of: wall time of the steps after the first (the first warms up),
CPU time in user and kernel mode, minor page faults, and the process's peak resident memory (VmHWM). The variants
are the entries of :data:`alignopsd.engine.infra.allocator.ALLOCATORS` that this machine has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from alignopsd.engine.infra.allocator import ALLOCATORS, allocator_env


def workload(steps: int) -> dict:
    """The measured work, run inside the variant's process; returns its counters."""
    import resource

    import torch
    from alignopsd.engine.models.loading import load_causal_lm, parse_dtype
    from alignopsd.engine.observe.memory import GIB, peak_rss_bytes
    from alignopsd.engine.policy.hf import HFPolicy

    from alignopsd.losses import ppo_loss

    torch.manual_seed(0)
    dtype = parse_dtype("auto")
    model = load_causal_lm("smollm2-135m", dtype=dtype)
    pol = HFPolicy(model, lr=1e-6, ddp=False)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (4, 256), generator=g)
    rows, lp, lr = 4, 256, 64
    ids = torch.randint(10, vocab, (rows, lp + lr), generator=g)
    mask = torch.ones(rows, lp + lr, dtype=torch.long)
    rmask = mask[:, lp:].float()
    adv = torch.randn(rows, lr, generator=g)

    def loss_fn(logp, ent):
        loss, _ = ppo_loss(logp.float(), logp.detach().float(), adv, rmask, clip_low=0.2, clip_high=0.28)
        return loss

    def usage():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt

    times = []
    start = None
    for step in range(steps):
        if step == 1:
            start = usage()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=True,
                temperature=0.5,
                pad_token_id=0,
            )
        pol.zero_grad()
        _, _, carrier = pol.response_loss(ids, mask, lr, loss_fn, loss_fill=None, with_entropy=False)
        carrier.backward()
        pol.optimizer_step(1.0)
        times.append(time.perf_counter() - t0)
    end = usage()
    return dict(
        wall_s=end[0] - start[0],
        user_s=end[1] - start[1],
        sys_s=end[2] - start[2],
        minflt=end[3] - start[3],
        peak_gib=peak_rss_bytes() / GIB,
        step_s=times,
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
    )


def run_variant(name: str, steps: int) -> dict:
    env = allocator_env(name, dict(os.environ))
    out = subprocess.run(
        [sys.executable, "-m", "bench.allocator", "--child", "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"variant {name} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(ALLOCATORS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(workload(a.steps)))
        return
    names = [n for n in a.variants.split(",") if n]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            res = run_variant(n, a.steps)
            res["load"] = os.getloadavg()[0]
            runs[n].append(res)
            print(
                f"round {r} {n}: wall {res['wall_s']:.1f} s user {res['user_s']:.1f} sys {res['sys_s']:.1f} "
                f"minflt {res['minflt']:,} peak {res['peak_gib']:.2f} GiB load {res['load']:.1f}",
                flush=True,
            )
    print("\n| allocator | wall s | user s | sys s | minor faults | peak GiB | wall vs default |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(x["wall_s"] for x in runs[names[0]])
    for n in names:
        med = {k: statistics.median(x[k] for x in runs[n]) for k in ("wall_s", "user_s", "sys_s", "minflt", "peak_gib")}
        print(
            f"| {n} | {med['wall_s']:.1f} | {med['user_s']:.1f} | {med['sys_s']:.1f} | {med['minflt']:,.0f} | "
            f"{med['peak_gib']:.2f} | {med['wall_s'] / base:.3f} |"
        )


if __name__ == "__main__":
    main()
