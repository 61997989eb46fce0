"""Environment worker processes and the round dispatcher of the environment manager (manager.py).

A worker process hosts environment instances by slot (one slot per episode) and runs the ops it is sent
in order, one reply per op. :class:`WorkerPool` runs one *round* of ops (one op per active episode: a
reset or a step) over its workers with these rules:

* **Deadlines.** Every op gets ``step_timeout`` seconds counted from the moment it starts (when the
  worker is handed it, or when the op before it on that worker answered); a rebuild (``replay``) gets
  ``step_timeout`` per replayed call. An episode fails only when its *own* op runs past its deadline
  or its worker dies under it; work queued behind a hung op is never charged for the wait.
* **Re-dispatch.** When an op hangs (or its worker dies) the worker is killed and relaunched without
  blocking the round. Every op that was queued behind the hung one is re-dispatched, one episode at a
  time, to the least loaded worker (a healthy one or the relaunched one), together with a rebuild of
  that episode's environment (its seeded reset and its actions so far; environments are deterministic
  given task and seed). Episodes of the killed worker whose op had already finished are rebuilt the
  same way. Re-dispatched work runs in parallel on all workers.
* **Accounting.** Every op of the round ends with a result: ``ok``, ``error`` (the environment raised,
  or rebuilding it failed) or ``failed`` (timed out, worker died). Counters go to the caller's metrics:
  ``timeouts`` (ops that hung), ``timeout_waves`` (the round's cost in timeouts: an op's *wave* is one
  more than the wave of the hang it was queued behind, and a round adds the largest wave of its hung
  ops, so ``G`` hanging siblings on one worker cost ``1 + ceil((G - 1) / num_workers)`` timeouts, not
  ``G``), ``worker_deaths``, ``worker_restarts``, ``redispatched_ops`` (queued ops moved off a killed
  worker), ``rebuilt_episodes`` (rebuilds sent), ``env_errors``.
"""

from __future__ import annotations

import random
import time
import traceback
from collections import deque
from multiprocessing.connection import wait as mp_wait
from typing import Any

from alignopsd.engine.envs.registry import resolve

__all__ = ["EnvHost", "WorkerPool", "WorkerProcess", "op_budget"]


class EnvHost:
    """Holds environment instances by slot and executes ops; used in workers and in-process."""

    def __init__(self, factory: str, env_kwargs: dict[str, Any]) -> None:
        self.factory = resolve(factory)
        self.env_kwargs = env_kwargs
        self.envs: dict[int, Any] = {}

    def _env(self, slot: int):
        env = self.envs.get(slot)
        if env is None:
            env = self.factory(**self.env_kwargs)
            self.envs[slot] = env
        return env

    def handle(self, op: tuple) -> tuple[int, str, Any]:
        """Run one op: ``(slot, "reset", task, seed)``, ``(slot, "replay", task, seed, actions)`` or
        ``(slot, "step", action)``. Returns ``(slot, "ok" | "error", payload)``; never raises."""
        slot, kind = op[0], op[1]
        try:
            if kind in ("reset", "replay"):
                task, seed = op[2], op[3]
                env = self._env(slot)
                random.seed(seed)
                obs, info = env.reset(task, seed)
                payload: Any = (obs, dict(info), int(env.max_steps))
                if kind == "replay":
                    for a in op[4]:
                        env.step(a)
                return slot, "ok", payload
            if kind == "step":
                if slot not in self.envs:
                    raise RuntimeError(f"no environment in slot {slot}")
                r = self.envs[slot].step(op[2])
                return slot, "ok", (r.observation, float(r.reward), bool(r.done), dict(r.info))
            raise ValueError(f"unknown op {kind!r}")
        except Exception as exc:  # noqa: BLE001 - any environment error ends only this episode
            self.envs.pop(slot, None)
            return slot, "error", f"env raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"


def worker_main(conn, factory: str, env_kwargs: dict[str, Any]) -> None:
    """Entry point of a worker process: announce readiness, then answer ``("ops", [op, ...])`` messages."""
    try:
        host = EnvHost(factory, env_kwargs)
    except Exception:  # noqa: BLE001
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg[0] == "close":
            return
        for op in msg[1]:
            conn.send(host.handle(op))


class WorkerProcess:
    """One worker process and its pipe."""

    def __init__(self, ctx, factory: str, env_kwargs: dict[str, Any], startup_timeout: float) -> None:
        self.ctx, self.factory, self.env_kwargs = ctx, factory, env_kwargs
        self.startup_timeout = startup_timeout
        self.proc = None
        self.conn = None
        self.booting = False  # launched, its ready announcement not read yet
        self.launched_at = 0.0

    def launch(self) -> None:
        self.booting, self.launched_at = True, time.monotonic()
        parent, child = self.ctx.Pipe(duplex=True)
        self.proc = self.ctx.Process(target=worker_main, args=(child, self.factory, self.env_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def await_ready(self) -> None:
        parent = self.conn
        if not parent.poll(self.startup_timeout):
            self.kill()
            raise RuntimeError(f"environment worker did not start within {self.startup_timeout:.0f}s")
        try:
            msg = parent.recv()
        except EOFError as exc:
            self.kill()
            raise RuntimeError("environment worker died while starting") from exc
        self.check_ready(msg)

    def check_ready(self, msg: tuple) -> None:
        """Raise a clear error unless ``msg`` is the worker's ready announcement."""
        if msg[0] != "ready":
            self.kill()
            raise RuntimeError(f"environment worker failed to start:\n{msg[1]}")
        self.booting = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(timeout=2)
        self.kill()


def op_budget(op: tuple, step_timeout: float) -> float:
    """Seconds an op may run: ``step_timeout`` per environment call (a replay makes 1 + its actions)."""
    if op[1] == "replay":
        return step_timeout * (1 + len(op[4]))
    return step_timeout


class WorkerPool:
    """``num_workers`` worker processes and the round dispatcher (see the module docstring)."""

    def __init__(self, ctx, factory: str, env_kwargs: dict[str, Any], num_workers: int, startup_timeout: float):
        self.workers = [WorkerProcess(ctx, factory, env_kwargs, startup_timeout) for _ in range(num_workers)]
        self.startup_timeout = startup_timeout
        for w in self.workers:  # start them all, then wait: imports overlap
            w.launch()
        try:
            for w in self.workers:
                w.await_ready()
        except BaseException:
            self.close()
            raise

    def run(
        self, ops: dict[int, tuple], episodes: list, step_timeout: float, metrics: dict[str, float]
    ) -> dict[int, tuple[str, Any]]:
        """Run one op per episode (``ops[idx]`` for ``episodes[idx]``); returns ``{idx: (status, payload)}``.

        ``episodes[idx].worker`` is updated when an episode moves to another worker.
        """
        return _Round(self, ops, episodes, step_timeout, metrics).run()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


class _Round:
    """State of one round: per-worker queues of sent ops, their start times, results."""

    def __init__(self, pool: WorkerPool, ops: dict[int, tuple], episodes: list, timeout: float, metrics: dict):
        self.pool, self.ops, self.episodes = pool, ops, episodes
        self.timeout, self.metrics = timeout, metrics
        n = len(pool.workers)
        self.queue: dict[int, deque] = {w: deque() for w in range(n)}
        self.started: dict[int, float] = {}
        self.dropped: set[int] = set()  # slots whose remaining replies are ignored (rebuild failed)
        self.results: dict[int, tuple[str, Any]] = {}
        self.wave: dict[int, int] = {}  # slot -> timeouts its op has waited through (see timeout_waves)
        self.max_wave = 0
        batches: dict[int, list[tuple]] = {w: [] for w in range(n)}
        for idx, op in ops.items():
            batches[episodes[idx].worker].append(op)
        for w, batch in batches.items():
            if batch:
                self._send(w, batch)

    def _booting(self, w: int) -> bool:
        return self.pool.workers[w].booting

    def _send(self, w: int, new_ops: list[tuple]) -> None:
        if not self.queue[w] and not self._booting(w):
            self.started[w] = time.monotonic()
        self.queue[w].extend(new_ops)
        try:
            self.pool.workers[w].conn.send(("ops", list(new_ops)))
        except OSError:  # the worker died while idle: the next read sees EOF and recovers it
            pass

    def _deadline(self, w: int) -> float:
        if self._booting(w):
            return self.pool.workers[w].launched_at + self.pool.startup_timeout
        return self.started[w] + op_budget(self.queue[w][0], self.timeout)

    def run(self) -> dict[int, tuple[str, Any]]:
        while any(self.queue.values()):
            active = [w for w, q in self.queue.items() if q]
            wait_s = max(0.0, min(self._deadline(w) for w in active) - time.monotonic())
            conn_to_w = {self.pool.workers[w].conn: w for w in active}
            dead: list[int] = []
            for conn in mp_wait(list(conn_to_w), timeout=wait_s):
                w = conn_to_w[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if self._booting(w):
                        self.pool.workers[w].kill()
                        raise RuntimeError("environment worker died while starting") from None
                    self.metrics["worker_deaths"] += 1
                    dead.append(w)
                    continue
                self._receive(w, msg)
            if dead:
                self._recover(dead, "worker process died")
            now = time.monotonic()
            hung = [w for w, q in self.queue.items() if q and now >= self._deadline(w)]
            for w in hung:
                if self._booting(w):
                    self.pool.workers[w].kill()
                    raise RuntimeError(f"environment worker did not restart within {self.pool.startup_timeout:.0f}s")
            if hung:
                self.metrics["timeouts"] += len(hung)
                self._recover(hung, f"timed out after {self.timeout:g}s", timed_out=True)
        self.metrics["timeout_waves"] += self.max_wave
        return self.results

    def _receive(self, w: int, msg: tuple) -> None:
        if self._booting(w):  # relaunched in this round or an earlier one: the first message is "ready"
            self.pool.workers[w].check_ready(msg)
            self.started[w] = time.monotonic()
            return
        slot, status, payload = msg
        op = self.queue[w].popleft()
        if op[0] != slot:  # protocol invariant: replies come in op order
            raise RuntimeError(f"worker {w} answered slot {slot}, expected {op[0]}")
        self.started[w] = time.monotonic()
        if status == "error":
            self.metrics["env_errors"] += 1
        if slot in self.dropped:
            return
        if op[1] != "replay":
            self.results[slot] = (status, payload)
        elif status != "ok":
            # Rebuilding this episode failed: it fails, and whatever of it is still queued is ignored.
            self.results[slot] = ("error", f"replay after worker restart failed: {payload}")
            self.dropped.add(slot)

    def _recover(self, ws: list[int], why: str, timed_out: bool = False) -> None:
        """Workers ``ws`` hung or died on their current op: fail that op's episode, relaunch each worker,
        and re-dispatch the rest of their episodes (queued ops and rebuilds) over all workers."""
        groups: list[list[tuple]] = []
        for w in ws:
            culprit = self.queue[w][0][0]
            wave = self.wave.get(culprit, 0) + int(timed_out)
            self.max_wave = max(self.max_wave, wave)
            for op in self.queue[w]:  # everything queued here waited through this hang
                self.wave[op[0]] = max(self.wave.get(op[0], 0), wave)
            self.results[culprit] = ("failed", why)
            self.dropped.add(culprit)
            worker = self.pool.workers[w]
            worker.kill()
            worker.launch()
            self.metrics["worker_restarts"] += 1
            self.queue[w].clear()
            groups += self._moved_work(w)
        for group in groups:
            target = min(self.queue, key=lambda v: (len(self.queue[v]) + self._booting(v), v))
            self.episodes[group[0][0]].worker = target
            self._send(target, group)

    def _moved_work(self, w: int) -> list[list[tuple]]:
        """Ops that rebuild (and, when unfinished, re-run) every live episode the killed worker ``w`` hosted."""
        groups: list[list[tuple]] = []
        for ep in self.episodes:
            own = self.ops.get(ep.idx)
            if ep.worker != w or ep.done or own is None or ep.idx in self.dropped:
                continue
            finished = self.results.get(ep.idx)
            if finished is not None:
                if finished[0] != "ok" or (own[1] == "step" and finished[1][2]):
                    continue  # failed, or the step ended the episode: nothing to rebuild
                actions = [] if own[1] == "reset" else [*ep.env_actions, own[2]]
                groups.append([(ep.idx, "replay", ep.task, ep.seed, actions)])
            elif own[1] == "reset":
                groups.append([own])
                self.metrics["redispatched_ops"] += 1
                continue
            else:
                groups.append([(ep.idx, "replay", ep.task, ep.seed, list(ep.env_actions)), own])
                self.metrics["redispatched_ops"] += 1
            self.metrics["rebuilt_episodes"] += 1
        return groups
