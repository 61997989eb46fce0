"""The time a fault costs a run: a rank SIGKILLed under ``torchrun --max-restarts=1`` (``kill``), or a preemption
(``term``: SIGTERM to the torchrun agent; the run finishes its step, checkpoints and exits 143, and is launched again),
both with ``--resume auto``, on a real config (default: the quickstart's SmolLM2-135M, 3 steps, a save every step).

    nice -n 5 .venv/bin/python bench/fault_cost.py --mode kill --out /tmp/fc-kill [--set KEY=VALUE ...]

The fault lands in step 2, ``--at`` (0.5) of step 1's time after step 1's checkpoint was written. Every output line of
the launch is stamped with the wall clock (``<out>.log``), the worker processes' start times are read from /proc, and
the run's own records give the rest: ``attempts.jsonl`` (each attempt's start, after the imports) and
``metrics.jsonl`` (each step's ``wall_time`` at its end and ``time/step_wall``). Printed as JSON (:func:`breakdown`):

- ``kill``: the lost time = the restart (fault -> the repeated step's start) + the part of step 2 done before the
  fault (repeated); the restart split into the agent's restart of the worker (fault -> new worker process), process
  start and imports (-> the attempt's start record), pre-flight and checkpoint verify (-> the dtype line, printed
  after the resume's checkpoint is resolved), model build and checkpoint load (-> ``[train] resumed from``), and the
  run's set-up before the step (history, loggers, audit);
- ``term``: the step in flight is finished and saved (useful work, reported apart); the lost time = the run's exit
  after the save + the relaunch -> step 3's start, split the same way.
``brief_formula_s``: fault -> the next attempt's first new step finished, minus that step's own time."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
QUICK = [
    "trainer.total_steps=3",
    "trainer.checkpoint.save_freq=1",
    "trainer.checkpoint.keep_last=3",
    "trainer.validation.after_train=false",
    "trainer.logging.report=false",
    "trainer.restarts.backoff_s=0",
]
SAVED_1 = "[train] checkpoint of step 1:"
DTYPE = "[dtype]"  # cfg.dtype_line(): printed after the pre-flight and the resume's checkpoint resolution
RESUMED = "[train] resumed from"


def _ticks_to_epoch() -> tuple[float, float]:
    boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot, float(os.sysconf("SC_CLK_TCK"))


def process_start(pid: int) -> float | None:
    """Wall-clock start of process ``pid`` (from /proc; None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    boot, hz = _ticks_to_epoch()
    return boot + int(fields[19]) / hz


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Launch:
    """One torchrun launch: its output lines stamped with the wall clock, its workers' pids and start times."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.workers: dict[int, float] = {}
        self.log = open(log, "a")  # noqa: SIM115 - closed by wait()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t = time.time()
            self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:.3f}\t{line}")
            self.log.flush()

    def poll_workers(self) -> None:
        for pid in children(self.proc.pid):
            if pid not in self.workers:
                start = process_start(pid)
                if start is not None:
                    self.workers[pid] = start

    def first(self, text: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.lines if t >= after and text in line), None)

    def wait(self, loads: list[float], until=None) -> None:
        while self.proc.poll() is None and not (until and until()):
            self.poll_workers()
            loads.append(os.getloadavg()[0])
            time.sleep(0.05)
        if self.proc.poll() is not None:
            self.reader.join()
            self.log.close()


def command(out: Path, config: str, sets: list[str], restarts: int) -> list[str]:
    args = [a for kv in [*QUICK, *sets, f"output_dir={out}"] for a in ("--set", kv)]
    return [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=1",
        f"--max-restarts={restarts}",
        "-m",
        "alignopsd.engine",
        "train",
        "--config",
        config,
        *args,
        "--resume",
        "auto",
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def breakdown(
    fault: float,
    step_start: float,
    metrics: list[dict],
    starts: list[float],
    worker_start: float,
    dtype_line: float,
    resumed_line: float,
    resumed_step: int,
    relaunch: float | None = None,
) -> dict:
    """The lost time of a fault in step 2 and its parts (seconds), from the timestamps named in the module's docstring.

    ``step_start``: when step 2 began (step 1's checkpoint written); ``metrics``: the train records of metrics.jsonl
    (each step once); ``starts``: the attempts' start times (attempts.jsonl); ``worker_start``: the next attempt's
    worker process start; ``resumed_step``: the step of the checkpoint it resumed from (1: step 2 is run again; 2: a
    preemption that finished and saved step 2 within its grace); ``relaunch``: when the run was launched again
    (a preemption; None: torchrun's agent restarted the worker)."""
    train = [r for r in metrics if r.get("kind", "train") == "train"]
    steps = [r["step"] for r in train]
    if steps != list(range(1, len(steps) + 1)) or len(steps) < 3:
        raise ValueError(f"metrics: steps {steps} are not 1..N (N >= 3), each once")
    by_step = {r["step"]: r for r in train}
    rec = by_step[resumed_step + 1]  # the next attempt's first new step
    wall = float(rec["time/step_wall"])
    new_start = float(rec["wall_time"]) - wall  # its start (its record is written at its end)
    attempt = next((s for s in starts if s > fault), None)
    if attempt is None:
        raise ValueError("attempts: no attempt started after the fault")
    out = {
        "resumed_from_step": resumed_step,
        "normal_step_s": {str(s): round(float(r["time/step_wall"]), 2) for s, r in sorted(by_step.items())},
        "brief_formula_s": round(float(rec["wall_time"]) - fault - wall, 2),
        "peak_rss_gib": max(float(r.get("memory/peak_rss_gib", 0.0)) for r in train),
    }
    parts = {}
    if relaunch is None:
        parts["agent_restarts_worker"] = worker_start - fault
    else:
        if resumed_step == 2:  # step 2 finished within the grace: useful work, then its checkpoint and the exit
            out["step_in_flight_finished_s"] = round(float(by_step[2]["wall_time"]) - fault, 2)
            parts["checkpoint_and_exit"] = relaunch - float(by_step[2]["wall_time"])
        else:  # the grace ran out (or the step was not saved): the wait for the exit is lost
            parts["wait_for_exit"] = relaunch - fault
        parts["relaunch_to_worker_start"] = worker_start - relaunch
    parts.update(
        process_start_and_imports=attempt - worker_start,
        preflight_and_checkpoint_verify=dtype_line - attempt,
        model_build_and_checkpoint_load=resumed_line - dtype_line,
        setup_before_step=new_start - resumed_line,
    )
    if resumed_step == 1:
        parts["repeated_partial_step"] = fault - step_start
    out["parts_s"] = {k: round(v, 2) for k, v in parts.items()}
    out["lost_s"] = round(sum(parts.values()), 2)
    return out


def run(mode: str, out: Path, config: str, sets: list[str], at: float) -> dict:
    if out.exists():
        raise SystemExit(f"--out: {out} exists; pick a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    log, loads = out.with_suffix(".log"), []
    cmd = command(out, config, sets, restarts=1 if mode == "kill" else 0)
    launch = Launch(cmd, log)
    launch.wait(loads, until=lambda: launch.first(SAVED_1) is not None)
    step_start = launch.first(SAVED_1)
    if step_start is None:
        raise SystemExit(f"the run ended before step 1's checkpoint; see {log}")
    step1 = read_jsonl(out / "metrics.jsonl")[0]["time/step_wall"]
    while time.time() < step_start + at * step1:
        loads.append(os.getloadavg()[0])
        time.sleep(0.05)
    launch.poll_workers()
    before = set(launch.workers)
    fault = time.time()
    if mode == "kill":
        os.kill(max(before), signal.SIGKILL)
    else:
        os.kill(launch.proc.pid, signal.SIGTERM)
    launch.log.write(f"{fault:.3f}\t# fault: {mode}\n")  # the log alone then holds every time the breakdown reads
    launch.wait(loads)
    relaunch = None
    if mode == "term":
        if launch.proc.returncode == 0:
            raise SystemExit(f"the run finished before the SIGTERM took; see {log}")
        relaunch, old = time.time(), launch
        launch = Launch(cmd, log)
        launch.lines, before = old.lines + launch.lines, set()
        launch.wait(loads)
    if launch.proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {launch.proc.returncode}); see {log}")
    new_workers = sorted(t for p, t in launch.workers.items() if p not in before)
    after = relaunch or fault
    resumed = launch.first(RESUMED, after)
    line = next(text for t, text in launch.lines if t == resumed and RESUMED in text)
    result = breakdown(
        fault,
        step_start,
        read_jsonl(out / "metrics.jsonl"),
        [e["time"] for e in read_jsonl(out / "attempts.jsonl") if e["event"] == "start"],
        new_workers[0],
        launch.first(DTYPE, after),
        resumed,
        int(re.search(r"at step (\d+)", line).group(1)),
        relaunch,
    )
    result["mode"] = mode
    result["fault_at_fraction_of_step_1"] = at
    result["load_avg_1min"] = {"min": min(loads), "mean": round(sum(loads) / len(loads), 2), "max": max(loads)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("kill", "term"), required=True)
    p.add_argument("--out", required=True, type=Path, help="a new run folder")
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart_cpu.yaml"))
    p.add_argument("--set", dest="sets", action="append", default=[], help="more overrides, KEY=VALUE")
    p.add_argument("--at", type=float, default=0.5, help="the fault's time into step 2, in step 1's times")
    args = p.parse_args(argv)
    print(json.dumps(run(args.mode, args.out, args.config, args.sets, args.at), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
