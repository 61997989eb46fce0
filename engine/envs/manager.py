"""Batched environment manager: G sibling episodes per task, environments in worker processes.

Usage::

    mgr = EnvManager("alfworld", num_workers=2, step_timeout=30.0)
    tasks = mgr.task_source("train", n=4, seed=0)
    obs, infos = mgr.reset(tasks, group_n=8, seed=0)     # 32 episodes, siblings consecutive
    while not all(dones):
        obs, rewards, dones, infos = mgr.step(responses)  # one raw model response per episode
    mgr.close()

Episode ``i`` plays ``tasks[i // group_n]``; siblings share the task *and* the environment seed
(derived from ``seed`` and the task index), so they start from the same observation.
``obs[i]`` is the full user-message text of the current turn (ALGORITHM.md §1.3 template, with
history), not the raw environment text (that is ``infos[i]["observation"]``).

``step(responses)`` takes exactly one response per episode (``len(responses) == num_episodes``);
entries for finished episodes are ignored (pass ``""`` or ``None``). A finished episode returns its
last observation, reward 0 and done True. Each active response is parsed (parsing.parse_response with
the environment's action tags): ``is_action_valid`` is true when the response is well formed (a
non-empty ``<think>`` block, exactly one action block, no CJK) **and** the action is admissible (for
environments that list admissible actions) **and** the environment did not report
``info["action_admissible"] = False`` for it. A well-formed action is lower-cased for ALFWorld and
handed to the environment even when it is not admissible (the engine answers "Nothing happens.");
a malformed response hands the environment the empty action ``""``, which every environment must
treat as a no-op that still costs a step. Parsing never raises.

Faults: every reset/step runs with a per-call timeout (``step_timeout``) counted from its own start.
An environment that raises, or returns a non-finite reward, ends its episode as failed (reward 0, done,
``infos["failed"] = True``, ``infos["failure"]`` says why) and its instance is discarded. An environment
that hangs past the timeout or whose worker process dies also fails its episode; the worker is killed and
relaunched, and the work queued behind the hung call is re-dispatched over all workers, each episode
rebuilt by replaying its seeded reset and its actions so far (environments are deterministic given task
and seed), so nothing else is lost and a round costs about one timeout (workers.py has the rules).
``metrics()`` counts all of it.

``num_workers=0`` runs the environments in this process (no timeouts; raising still fails only the
episode): useful for tiny tests and for the toy environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from alignopsd.engine.envs.base import TaskSpec
from alignopsd.engine.envs.parsing import parse_response
from alignopsd.engine.envs.prompts import PromptContext
from alignopsd.engine.envs.registry import get_entry, load_tasks, make_prompt, resolve
from alignopsd.engine.envs.workers import EnvHost, WorkerPool

__all__ = ["EnvManager", "derive_seed", "load_tasks"]


def derive_seed(seed: int, *parts: object) -> int:
    """A 31-bit seed derived from ``seed`` and ``parts`` (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------------
# Parent side


@dataclass
class _Episode:
    idx: int
    task: TaskSpec
    seed: int
    worker: int
    max_steps: int = 50
    task_text: str = ""
    obs_raw: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    history: list[tuple[str, str]] = field(default_factory=list)
    env_actions: list[str] = field(default_factory=list)
    done: bool = False
    failed: bool = False
    failure: str = ""
    won: bool = False
    reward_sum: float = 0.0
    prompt: str = ""


class EnvManager:
    """Batched, fault-tolerant environment manager (see the module docstring).

    Args:
        env_name: a registered environment name (registry.env_names()).
        num_workers: worker processes (episodes are dealt round robin, siblings on different workers); 0 runs the
            environments in this process.
        step_timeout: seconds one reset or step may take before its episode is failed.
        history_length: (observation, action) pairs shown in the prompt (default: the env's, §1.3).
        max_steps: episode step limit (default: the environment's ``max_steps``).
        mp_context: multiprocessing start method ("spawn" or "forkserver").
        startup_timeout: seconds a worker may take to start (imports).
        **env_kwargs: passed to the environment factory in every worker.
    """

    def __init__(
        self,
        env_name: str,
        num_workers: int = 2,
        step_timeout: float = 60.0,
        *,
        history_length: int | None = None,
        max_steps: int | None = None,
        mp_context: str = "spawn",
        startup_timeout: float = 120.0,
        **env_kwargs: Any,
    ) -> None:
        self.entry = get_entry(env_name)
        self.env_name = env_name
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers: expected an int >= 0, got {num_workers!r}")
        if not (isinstance(step_timeout, (int, float)) and step_timeout > 0):
            raise ValueError(f"step_timeout: expected a positive number, got {step_timeout!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps <= 0):
            raise ValueError(f"max_steps: expected a positive int or None, got {max_steps!r}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context: expected 'spawn' or 'forkserver', got {mp_context!r}")
        self.num_workers = num_workers
        self.step_timeout = float(step_timeout)
        self.max_steps = max_steps
        self.env_kwargs = env_kwargs
        self.prompt = make_prompt(env_name, history_length)
        self._ctx = mp.get_context(mp_context)
        self._pool: WorkerPool | None = None
        self._host: EnvHost | None = None
        self.episodes: list[_Episode] = []
        self._metrics: dict[str, float] = dict(
            episodes=0,
            failed_episodes=0,
            env_errors=0,
            timeouts=0,
            timeout_waves=0,
            worker_deaths=0,
            worker_restarts=0,
            redispatched_ops=0,
            rebuilt_episodes=0,
            nonfinite_rewards=0,
            steps=0,
            invalid_actions=0,
            env_time_s=0.0,
        )
        if num_workers == 0:
            self._host = EnvHost(self.entry.factory, env_kwargs)
        else:
            self._pool = WorkerPool(self._ctx, self.entry.factory, env_kwargs, num_workers, startup_timeout)

    # -- public API --------------------------------------------------------------------------------

    def task_source(self, split: str = "train", n: int | None = None, seed: int = 0, **kw: Any) -> list[TaskSpec]:
        """Seeded tasks of ``split`` for this environment (registry task source)."""
        return load_tasks(self.env_name, split, n, seed, **{**self._task_kwargs(), **kw})

    @contextlib.contextmanager
    def step_limit(self, max_steps: int) -> Iterator[None]:
        """Episodes reset inside the block end after ``max_steps`` steps (a warm start's expert episodes may take
        more turns than the rollout's); the manager's own limit again after it."""
        if not isinstance(max_steps, int) or max_steps <= 0:
            raise ValueError(f"max_steps: expected a positive int, got {max_steps!r}")
        before, self.max_steps = self.max_steps, max_steps
        try:
            yield
        finally:
            self.max_steps = before

    def _task_kwargs(self) -> dict[str, Any]:
        keys = ("data_dir", "cache_dir")
        return {k: self.env_kwargs[k] for k in keys if k in self.env_kwargs}

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    def reset(self, tasks: list[TaskSpec], group_n: int = 1, seed: int = 0) -> tuple[list[str], list[dict]]:
        """Start ``len(tasks) * group_n`` episodes (siblings consecutive); returns (prompts, infos)."""
        if not isinstance(tasks, (list, tuple)) or not tasks or not all(isinstance(t, TaskSpec) for t in tasks):
            raise ValueError("tasks: expected a non-empty list of TaskSpec")
        if not isinstance(group_n, int) or group_n < 1:
            raise ValueError(f"group_n: expected an int >= 1, got {group_n!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed: expected an int, got {seed!r}")
        nw = max(self.num_workers, 1)
        self.episodes = []
        for ti, task in enumerate(tasks):
            env_seed = derive_seed(seed, "task", ti, task.key)
            for _ in range(group_n):
                i = len(self.episodes)
                # Round robin: the siblings of a task sit on different workers, so if the task's environment
                # hangs they time out together (one timeout for the round) instead of one behind the other.
                self.episodes.append(_Episode(i, task, env_seed, i % nw))
        self._metrics["episodes"] += len(self.episodes)
        ops = {ep.idx: (ep.idx, "reset", ep.task, ep.seed) for ep in self.episodes}
        results = self._run(ops)
        for ep in self.episodes:
            status, payload = results[ep.idx]
            if status != "ok":
                self._fail(ep, payload)
                continue
            obs, info, env_max = payload
            ep.max_steps = self.max_steps or env_max
            ep.obs_raw, ep.info = obs, info
            ep.task_text = str(info.get("task", ""))
        return [self._render(ep) for ep in self.episodes], [self._infos(ep, valid=True) for ep in self.episodes]

    def step(self, responses: list[str | None]) -> tuple[list[str], list[float], list[bool], list[dict]]:
        """One turn for every active episode; ``responses`` has one entry per episode (see module doc)."""
        if not self.episodes:
            raise ValueError("step() called before reset()")
        if not isinstance(responses, (list, tuple)) or len(responses) != len(self.episodes):
            n = len(responses) if isinstance(responses, (list, tuple)) else type(responses).__name__
            raise ValueError(f"responses: expected {len(self.episodes)} entries (one per episode), got {n}")
        ops: dict[int, tuple] = {}
        parsed: dict[int, tuple[str, str, bool, Any]] = {}
        for ep in self.episodes:
            if ep.done:
                continue
            text = responses[ep.idx]
            text = text if isinstance(text, str) else ""
            env_action, shown, valid, p = self._project(ep, text)
            parsed[ep.idx] = (env_action, shown, valid, p)
            ops[ep.idx] = (ep.idx, "step", env_action)
        results = self._run(ops)
        rewards = [0.0] * len(self.episodes)
        valids: dict[int, bool] = {}
        for idx, (status, payload) in results.items():
            ep = self.episodes[idx]
            env_action, shown, valid, p = parsed[idx]
            valids[idx] = valid
            self._metrics["steps"] += 1
            self._metrics["invalid_actions"] += int(not valid)
            if status != "ok":
                self._fail(ep, payload)
                ep.history.append((ep.obs_raw, shown))
                continue
            obs, reward, done, info = payload
            if not math.isfinite(reward):  # a broken reward fails its episode, like a crashed environment
                self._metrics["nonfinite_rewards"] += 1
                self._fail(ep, f"environment returned a non-finite reward ({reward!r})")
                ep.history.append((ep.obs_raw, shown))
                continue
            if info.get("action_admissible") is False:  # the environment's own verdict (WebShop, Search)
                valids[idx] = False
                self._metrics["invalid_actions"] += int(parsed[idx][2])
            ep.env_actions.append(env_action)
            ep.history.append((ep.obs_raw, shown))
            ep.obs_raw, ep.info = obs, info
            ep.won = bool(info.get("won", False))
            ep.reward_sum += reward
            rewards[idx] = reward
            ep.done = bool(done) or ep.won or len(ep.history) >= ep.max_steps
            info_extra = {"action": shown, "thinking_valid": p.thinking_valid, "parse_reason": p.reason}
            ep.info = {**info, **info_extra}
        obs_out = [self._render(ep) if ep.idx in results else ep.prompt for ep in self.episodes]
        infos = [self._infos(ep, valid=valids.get(ep.idx, True)) for ep in self.episodes]
        return obs_out, rewards, [ep.done for ep in self.episodes], infos

    def metrics(self) -> dict[str, float]:
        """Counters since construction: episodes, failed_episodes, env_errors, timeouts, timeout_waves,
        worker_deaths, worker_restarts, redispatched_ops, rebuilt_episodes, nonfinite_rewards, steps,
        invalid_actions, env_time_s (workers.py defines the dispatch counters)."""
        return dict(self._metrics)

    def episode_results(self) -> list[dict[str, Any]]:
        """Per-episode summary of the current batch (for success metrics such as category_success)."""
        return [
            dict(
                task_key=ep.task.key,
                category=ep.task.category,
                data_source=ep.task.data_source,
                won=ep.won,
                failed=ep.failed,
                reward=ep.reward_sum,
                steps=len(ep.history),
                task_score=ep.info.get("task_score"),
            )
            for ep in self.episodes
        ]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        self._pool = None
        self._host = None

    def __enter__(self) -> EnvManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- internals ---------------------------------------------------------------------------------

    def _project(self, ep: _Episode, text: str):
        """Response -> (action handed to the env, action shown in history, is_action_valid, parsed)."""
        tags = self.entry.action_tags
        p = parse_response(text, tags)
        if not p.well_formed:
            return "", p.action or "(invalid)", False, p
        action = " ".join(p.action.split())
        if self.entry.lowercase_actions:
            action = action.lower()
        valid = True
        if self.entry.admissible_check:
            valid = action in (ep.info.get("admissible_actions") or [])
        env_action = f"<{p.tag}>{action}</{p.tag}>" if len(tags) > 1 else action
        return env_action, action, valid, p

    def _fail(self, ep: _Episode, why: str) -> None:
        ep.failed, ep.done, ep.won, ep.failure = True, True, False, str(why)
        ep.reward_sum = 0.0
        self._metrics["failed_episodes"] += 1

    def _render(self, ep: _Episode) -> str:
        ctx = PromptContext(
            task=ep.task_text,
            observation=ep.obs_raw,
            admissible_actions=list(ep.info.get("admissible_actions") or []),
            history=ep.history,
            info=ep.info,
        )
        ep.prompt = self.prompt.render(ctx)
        return ep.prompt

    def _infos(self, ep: _Episode, valid: bool) -> dict[str, Any]:
        info = dict(ep.info)
        info.update(
            won=ep.won,
            is_action_valid=bool(valid),
            admissible_actions=list(ep.info.get("admissible_actions") or []),
            category=ep.task.category,
            data_source=ep.task.data_source,
            **(resolve(self.entry.task_info)(ep.task) if self.entry.task_info else {}),
            task_key=ep.task.key,
            failed=ep.failed,
            failure=ep.failure,
            observation=ep.obs_raw,
            step=len(ep.history),
            max_steps=ep.max_steps,
        )
        return info

    def _run(self, ops: dict[int, tuple]) -> dict[int, tuple[str, Any]]:
        """Execute one op per episode; returns {episode: (status, payload)} with status ok/error/failed."""
        t0 = time.perf_counter()
        try:
            if self._host is not None:
                out = {}
                for idx, op in ops.items():
                    _, status, payload = self._host.handle(op)
                    if status == "error":
                        self._metrics["env_errors"] += 1
                    out[idx] = (status, payload)
                return out
            assert self._pool is not None
            return self._pool.run(ops, self.episodes, self.step_timeout, self._metrics)
        finally:
            self._metrics["env_time_s"] += time.perf_counter() - t0
