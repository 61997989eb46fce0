"""Multi-turn sibling rollout: tasks x G episodes through the environment manager -> one TurnBatch.

Legend: M = turn rows, Lp = max_prompt_length (left-padded), L = padded response length (right-padded),
Lt = teacher-prompt length (left-padded, at most max_prompt_length).

Per turn, for every still-active episode (ALGORITHM.md §1.1, §1.3, §1.4):
1. the manager's observation text becomes one user message through the tokenizer's chat template with the
   generation prompt added (``envs.prompts.chat_text``), tokenised without extra special tokens;
2. a prompt longer than ``max_prompt_length`` is handled by the truncation mode (§1.3): ``"error"`` (ALFWorld,
   WebShop) raises ValueError, ``"left"`` (Search) keeps the tail; each truncation is counted;
3. the generator samples one response per active episode (stop at the closing action tag, per-turn budget
   ``sampling.max_new_tokens``); a response that used the whole budget is marked ``truncated``; an empty
   response gets the end-of-turn token appended so every turn has at least one policy token (§7.16);
4. the manager steps every active episode with its decoded response; the row keeps the step's validity,
   reward and metadata; finished episodes leave the active set.
At the end each row's ``outcome`` is its episode's summed reward. Rows are ordered by episode then turn.

Identity: ``task`` = ``task_offset`` + index of the task in ``tasks``; ``rollout`` = sibling index in
[0, group_n); ``turn`` = step index in the episode.

Teacher prompts (§1.4): the student prompt tokens are decoded with special tokens kept, the block
``"[Privileged Skill Information]\\n" + skill + "\\n\\n"`` is put in front of the whole chat-templated text,
the result is re-tokenised without adding special tokens, left-truncated to ``max_prompt_length`` (the skill
is lost first; counted) and left-padded (``envs.skills.build_teacher_prompts``). The skill text comes from the
environments' skill bank (``envs.skills.skill_lookup``), or from a caller-given ``skill_lookup``.

Failed environments (an environment that raised, hung or died; the manager ends the episode with
``failed=True``): by default (``failed_episodes="keep"``) their rows are kept with outcome 0, the same as the
manager's episode reward, so that every task keeps its G siblings (group-relative statistics need them);
``"drop"`` removes every row of a failed episode. Both are counted in the metrics.

Validation mode: group size 1, its own seeds (salted, so validation never replays a training rollout), and
temperature 0.4 when no sampling settings are given (§5).

Metrics (``batch.extras["rollout_metrics"]``): turns, episodes, success rate, valid-action rate,
per-category success, response lengths, prompt/response truncation counts, empty responses, failed
episodes, generation vs environment seconds, generated tokens per second.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from alignopsd.engine.batch import TurnBatch
from alignopsd.engine.generation.base import SamplingParams

log = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left")
VAL_TEMPERATURE = 0.4


def _seed(seed: int, *parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def default_truncation(env_name: str) -> str:
    """§1.3: ``left`` for Search, ``error`` for ALFWorld/WebShop (and any other environment)."""
    return "left" if str(env_name).lower().startswith("search") else "error"


def truncate_left(ids: list[int], max_len: int) -> tuple[list[int], bool]:
    """Keep the last ``max_len`` tokens; returns (ids, whether anything was cut)."""
    if len(ids) <= max_len:
        return list(ids), False
    return list(ids[len(ids) - max_len :]), True


def left_pad(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, width] ids, [n, width] mask) with each row right-aligned."""
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"rows: row {i} has {len(r)} tokens, more than the width {width}")
        if r:
            ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(
    rows: Sequence[Sequence[Any]], width: int, pad: Any, dtype=torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, width] values, [n, width] mask) with each row left-aligned."""
    vals = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            vals[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
            mask[i, : len(r)] = 1
    return vals, mask


# ----------------------------------------------------------------------------------------------------------------------
# teacher prompts
# ----------------------------------------------------------------------------------------------------------------------


def _skill_lookup(env_name: str) -> Callable[[dict], str] | None:
    """The environments' skill lookup for ``env_name`` (row metadata -> skill text); None without a skill bank."""
    from alignopsd.engine.envs.skills import skill_lookup  # noqa: PLC0415

    return skill_lookup(env_name)


# ----------------------------------------------------------------------------------------------------------------------
# rollout
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class _Row:
    episode: int
    task: int
    rollout: int
    turn: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    response_text: str
    prompt_text: str
    truncated: bool
    action_valid: bool
    won: bool
    category: str
    data_source: str
    gamefile: str | None
    task_key: str
    meta: dict


def _end_of_turn_id(tokenizer, generator) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        ids = sorted(getattr(generator, "eos_token_ids", []) or [])
        if not ids:
            raise ValueError("tokenizer: no eos_token_id to close an empty response")
        eos = ids[0]
    return int(eos)


def collect_rollouts(
    env_manager,
    generator,
    tokenizer,
    tasks: Sequence,
    *,
    group_n: int = 8,
    sampling: SamplingParams | None = None,
    max_prompt_length: int = 2048,
    max_response_length: int | None = None,
    max_turns: int | None = None,
    seed: int = 0,
    validation: bool = False,
    truncation: str | None = None,
    teacher_prompts: bool = True,
    skill_lookup: Callable[[dict], str] | None = None,
    failed_episodes: str = "keep",
    task_offset: int = 0,
    pad_token_id: int | None = None,
) -> TurnBatch:
    """Play ``len(tasks) * group_n`` episodes to the end and return their turn rows (see the module docstring).

    env_manager: an ``EnvManager`` (``reset(tasks, group_n, seed)``, ``step(responses)``). generator: a
    ``GenerationBackend``. tokenizer: the policy's tokenizer (chat template). sampling: the rollout's sampling
    settings; ``max_new_tokens`` is the per-turn response budget unless ``max_response_length`` is given.
    max_turns: turn limit (default: the manager's episode limit). truncation: "error" | "left" (default per
    environment, §1.3). teacher_prompts: also build the privileged teacher prompt of every row (§1.4), with
    ``skill_lookup(row_meta) -> skill text`` (default: the environments' skill bank for this environment; an
    environment without a skill bank gets the empty skill). failed_episodes: "keep" (outcome 0) | "drop".
    task_offset: added to the task ids (distinct ids across data-parallel ranks).
    """
    if not tasks:
        raise ValueError("tasks: expected a non-empty list of tasks")
    if validation:
        group_n = 1
    if not isinstance(group_n, int) or group_n < 1:
        raise ValueError(f"group_n: expected an int >= 1, got {group_n!r}")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length: must be >= 1, got {max_prompt_length}")
    if failed_episodes not in ("keep", "drop"):
        raise ValueError(f"failed_episodes: expected 'keep' or 'drop', got {failed_episodes!r}")
    env_name = getattr(env_manager, "env_name", "")
    truncation = truncation or default_truncation(env_name)
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation: expected one of {TRUNCATION_MODES}, got {truncation!r}")
    if sampling is None:
        sampling = SamplingParams(temperature=VAL_TEMPERATURE) if validation else SamplingParams()
    if max_response_length is not None:
        sampling = replace(sampling, max_new_tokens=int(max_response_length))
    budget = int(sampling.max_new_tokens)
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
    base_seed = _seed(seed, "validation") if validation else int(seed)
    pad_id = pad_token_id if pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    eot_id = _end_of_turn_id(tokenizer, generator)
    pad_id = eot_id if pad_id is None else int(pad_id)

    from alignopsd.engine.envs.prompts import chat_text  # noqa: PLC0415
    from alignopsd.engine.envs.skills import build_teacher_prompts  # noqa: PLC0415

    t_gen = t_env = 0.0
    t0 = time.perf_counter()
    obs, infos = env_manager.reset(list(tasks), group_n=group_n, seed=base_seed)
    t_env += time.perf_counter() - t0
    n_ep = len(obs)
    if n_ep != len(tasks) * group_n:
        raise ValueError(f"env_manager: reset returned {n_ep} episodes, expected {len(tasks) * group_n}")
    active = [not bool(info.get("failed", False)) for info in infos]
    failed = [bool(info.get("failed", False)) for info in infos]
    ep_reward = [0.0] * n_ep
    ep_won = [False] * n_ep
    limit = max_turns if max_turns is not None else max(int(info.get("max_steps") or 0) for info in infos) or 50
    rows: list[_Row] = []
    counts = dict(prompt_truncated=0, response_truncated=0, empty_responses=0, generated_tokens=0)
    turn = 0
    while turn < limit and any(active):
        act = [i for i in range(n_ep) if active[i]]
        prompt_ids, prompt_texts = [], []
        for i in act:
            text = chat_text(tokenizer, obs[i])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_length and truncation == "error":
                raise ValueError(
                    f"max_prompt_length: the prompt of episode {i} turn {turn} has {len(ids)} tokens "
                    f"(> {max_prompt_length}) and truncation is 'error'"
                )
            ids, cut = truncate_left(ids, max_prompt_length)
            counts["prompt_truncated"] += int(cut)
            prompt_ids.append(ids)
            prompt_texts.append(text)
        sp = replace(sampling, seed=_seed(base_seed, "generate", turn))
        t1 = time.perf_counter()
        out = generator.generate(prompt_ids, sp)
        t_gen += time.perf_counter() - t1
        if len(out.token_ids) != len(act):
            raise ValueError(f"generator: returned {len(out.token_ids)} responses for {len(act)} prompts")
        responses: list[str | None] = [None] * n_ep
        for k, i in enumerate(act):
            responses[i] = out.texts[k]
        t2 = time.perf_counter()
        new_obs, rewards, dones, new_infos = env_manager.step(responses)
        t_env += time.perf_counter() - t2
        for k, i in enumerate(act):
            resp = list(out.token_ids[k])
            lps = [float(x) for x in (out.logprobs[k] if out.logprobs else [0.0] * len(resp))]
            counts["generated_tokens"] += len(resp)
            reason = out.finish_reasons[k] if out.finish_reasons else ("length" if len(resp) >= budget else "stop")
            was_cut = reason == "length" or len(resp) >= budget
            counts["response_truncated"] += int(was_cut)
            if not resp:
                resp, lps = [eot_id], [0.0]
                counts["empty_responses"] += 1
            info_before, info = infos[i], new_infos[i]
            rows.append(
                _Row(
                    episode=i,
                    task=task_offset + i // group_n,
                    rollout=i % group_n,
                    turn=turn,
                    prompt_ids=prompt_ids[k],
                    response_ids=resp,
                    logprobs=lps[: len(resp)] + [0.0] * (len(resp) - len(lps)),
                    response_text=out.texts[k],
                    prompt_text=prompt_texts[k],
                    truncated=was_cut,
                    action_valid=bool(info.get("is_action_valid", False)),
                    won=bool(info.get("won", False)),
                    category=str(info.get("category") or info_before.get("category") or ""),
                    data_source=str(info.get("data_source") or info_before.get("data_source") or "text"),
                    gamefile=info_before.get("gamefile", info.get("gamefile")),
                    task_key=str(info.get("task_key") or info_before.get("task_key") or ""),
                    meta={**info_before, "prompt_text": prompt_texts[k]},
                )
            )
            ep_reward[i] += float(rewards[i])
            ep_won[i] = ep_won[i] or bool(info.get("won", False))
            if info.get("failed", False):
                failed[i] = True
            if dones[i] or failed[i]:
                active[i] = False
        obs, infos = new_obs, new_infos
        turn += 1
    outcome = [0.0 if failed[i] else ep_reward[i] for i in range(n_ep)]
    dropped = 0
    if failed_episodes == "drop":
        keep = [r for r in rows if not failed[r.episode]]
        dropped = len(rows) - len(keep)
        rows = keep
    if not rows:
        raise ValueError("env_manager: the rollout produced no turn (every episode failed at reset or was dropped)")

    # ---- tensors
    width_r = max(len(r.response_ids) for r in rows)
    p_ids, p_mask = left_pad([r.prompt_ids for r in rows], max_prompt_length, pad_id)
    r_ids, r_mask = right_pad([r.response_ids for r in rows], width_r, pad_id)
    r_lp, _ = right_pad([r.logprobs for r in rows], width_r, 0.0, dtype=torch.float32)
    batch = TurnBatch(
        task=torch.tensor([r.task for r in rows], dtype=torch.long),
        rollout=torch.tensor([r.rollout for r in rows], dtype=torch.long),
        turn=torch.tensor([r.turn for r in rows], dtype=torch.long),
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        response_ids=r_ids,
        response_mask=r_mask,
        outcome=torch.tensor([outcome[r.episode] for r in rows], dtype=torch.float32),
        action_valid=torch.tensor([r.action_valid for r in rows], dtype=torch.bool),
        won=torch.tensor([ep_won[r.episode] for r in rows], dtype=torch.bool),
        truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
        data_source=[r.data_source for r in rows],
        category=[r.category for r in rows],
        gamefile=[r.gamefile for r in rows],
        response_text=[r.response_text for r in rows],
        prompt_text=[r.prompt_text for r in rows],
        task_key=[r.task_key for r in rows],
        rollout_logp=r_lp * r_mask,
    )
    teacher_cut = 0
    if teacher_prompts:
        lookup = skill_lookup if skill_lookup is not None else _skill_lookup(env_name)
        metas = [
            {
                **r.meta,
                "gamefile": r.gamefile,
                "data_source": r.data_source,
                "category": r.category,
                "task_key": r.task_key,
            }
            for r in rows
        ]
        skills = [lookup(m) if lookup is not None else "" for m in metas]
        t_ids, t_mask, teacher_cut = build_teacher_prompts(tokenizer, p_ids, p_mask, skills, max_prompt_length, pad_id)
        start = int(t_mask.any(0).nonzero().min())  # drop the columns that are padding in every row
        batch.teacher_prompt_ids, batch.teacher_prompt_mask = t_ids[:, start:], t_mask[:, start:]

    # ---- metrics
    episodes = [i for i in range(n_ep) if not (failed_episodes == "drop" and failed[i])]
    lens = r_mask.sum(1).float()
    cats: dict[str, list[bool]] = {}
    for i in episodes:
        cats.setdefault(str(getattr(tasks[i // group_n], "category", "") or "all"), []).append(ep_won[i])
    gen_tokens = counts["generated_tokens"]
    metrics: dict[str, float] = {
        "turns": float(len(rows)),
        "episodes": float(len(episodes)),
        "success_rate": (sum(ep_won[i] for i in episodes) / len(episodes)) if episodes else 0.0,
        "reward_mean": (sum(outcome[i] for i in episodes) / len(episodes)) if episodes else 0.0,
        "valid_action_rate": float(batch.action_valid.float().mean()),
        "response_length_mean": float(lens.mean()),
        "response_length_max": float(lens.max()),
        "prompt_length_mean": float(p_mask.sum(1).float().mean()),
        "prompt_truncated": float(counts["prompt_truncated"]),
        "teacher_prompt_truncated": float(teacher_cut),
        "response_truncated": float(counts["response_truncated"]),
        "empty_responses": float(counts["empty_responses"]),
        "failed_episodes": float(sum(failed)),
        "dropped_rows": float(dropped),
        "generation_s": t_gen,
        "environment_s": t_env,
        "generated_tokens": float(gen_tokens),
        "generation_tokens_per_s": gen_tokens / t_gen if t_gen > 0 else 0.0,
    }
    for c, wins in sorted(cats.items()):
        metrics[f"success/{c}"] = sum(wins) / len(wins)
    batch.extras["rollout_metrics"] = metrics
    return batch


class RolloutWorker:
    """Holds the rollout's fixed pieces and settings; ``collect(tasks, seed)`` returns one TurnBatch.

    ``last_metrics`` keeps the metrics of the latest call (also in ``batch.extras["rollout_metrics"]``).
    """

    def __init__(self, env_manager, generator, tokenizer, **settings: Any) -> None:
        self.env_manager = env_manager
        self.generator = generator
        self.tokenizer = tokenizer
        self.settings = settings
        self.last_metrics: dict[str, float] = {}

    def collect(self, tasks: Sequence, *, seed: int, validation: bool = False, **overrides: Any) -> TurnBatch:
        kw = {**self.settings, **overrides}
        batch = collect_rollouts(
            self.env_manager, self.generator, self.tokenizer, tasks, seed=seed, validation=validation, **kw
        )
        self.last_metrics = dict(batch.extras.get("rollout_metrics", {}))
        return batch
