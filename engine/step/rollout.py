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

import torch
from alignopsd.engine.envs.prompts import chat_text
from alignopsd.engine.envs.registry import TRUNCATION_MODES, get_entry
from alignopsd.engine.envs.skills import build_teacher_prompts, teacher_prompt_text
from alignopsd.engine.envs.skills import skill_lookup as env_skill_lookup
from alignopsd.engine.generation.base import SamplingParams
from alignopsd.engine.observe.progress import time_left
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.tokens.layout import left_pad, right_pad, truncate_left
from alignopsd.engine.tokens.special import token_ids

log = logging.getLogger(__name__)

VAL_TEMPERATURE = 0.4


def _seed(seed: int, *parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def default_truncation(env_name: str) -> str:
    """§1.3: the environment's registry entry decides (``left`` for Search, ``error`` for ALFWorld/WebShop)."""
    return get_entry(env_name).truncation


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
    truth: dict | None = None  # the environment's ground truth of the state this turn was played in


def _truth(info: dict) -> dict | None:
    """The ``truth`` an environment reports in its info for the state a turn is played in (a JSON-able dict; the
    audit records it per turn), or None; anything else is dropped with a warning rather than ending the run."""
    truth = info.get("truth")
    if truth is None or isinstance(truth, dict):
        return truth
    log.warning("environment info: 'truth' must be a dict, got %s; not recorded", type(truth).__name__)
    return None


@dataclass
class _Settings:
    """The checked settings of one :func:`collect_rollouts` call."""

    group_n: int
    sampling: SamplingParams
    budget: int
    max_prompt_length: int
    max_turns: int | None
    base_seed: int
    truncation: str
    pad_id: int
    eot_id: int
    env_name: str
    failed_episodes: str
    task_offset: int
    student_skills: Callable[[dict], str] | None = None  # skill lookup when the skill is in the student prompt


@dataclass
class _Episodes:
    """Per-episode state of a rollout and its turn rows."""

    failed: list[bool]
    reward: list[float]
    won: list[bool]
    rows: list[_Row]
    counts: dict
    t_gen: float = 0.0
    t_env: float = 0.0


def _check_settings(
    env_manager,
    generator,
    tokenizer,
    *,
    group_n,
    sampling,
    max_prompt_length,
    max_response_length,
    max_turns,
    seed,
    validation,
    truncation,
    failed_episodes,
    task_offset,
    pad_token_id,
):
    """The call's settings, checked (ValueError names the culprit)."""
    if validation:
        group_n = 1
    if not isinstance(group_n, int) or group_n < 1:
        raise ValueError(f"group_n: expected an int >= 1, got {group_n!r}")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length: must be >= 1, got {max_prompt_length}")
    if failed_episodes not in ("keep", "drop"):
        raise ValueError(f"failed_episodes: expected 'keep' or 'drop', got {failed_episodes!r}")
    env_name = env_manager.env_name
    truncation = truncation or default_truncation(env_name)
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation: expected one of {TRUNCATION_MODES}, got {truncation!r}")
    if sampling is None:
        sampling = SamplingParams(temperature=VAL_TEMPERATURE) if validation else SamplingParams()
    if max_response_length is not None:
        sampling = replace(sampling, max_new_tokens=int(max_response_length))
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
    ids = token_ids(tokenizer, stop=generator.eos_token_ids, pad=pad_token_id)
    return _Settings(
        group_n=group_n,
        sampling=sampling,
        budget=int(sampling.max_new_tokens),
        max_prompt_length=max_prompt_length,
        max_turns=max_turns,
        base_seed=_seed(seed, "validation") if validation else int(seed),
        truncation=truncation,
        pad_id=ids.pad,
        eot_id=ids.end_of_turn("close an empty response"),
        env_name=env_name,
        failed_episodes=failed_episodes,
        task_offset=task_offset,
    )


def _turn_prompts(tokenizer, obs: list[str], infos, act: list[int], turn: int, st: _Settings, counts: dict):
    """(prompt ids, prompt texts) of the active episodes' observations (§1.3), truncation applied and counted.

    With ``st.student_skills`` (the Skill-Prompt / Skill-GRPO baselines) the skill block of §1.4 is put in front
    of the student's own prompt, as it is in front of the teacher's."""
    prompt_ids, prompt_texts = [], []
    for i in act:
        text = chat_text(tokenizer, obs[i])
        if st.student_skills is not None:
            text = teacher_prompt_text(st.student_skills({**infos[i], "prompt_text": text}), text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > st.max_prompt_length and st.truncation == "error":
            raise ValueError(
                f"max_prompt_length: the prompt of episode {i} turn {turn} has {len(ids)} tokens "
                f"(> {st.max_prompt_length}) and truncation is 'error'"
            )
        ids, cut = truncate_left(ids, st.max_prompt_length)
        counts["prompt_truncated"] += int(cut)
        prompt_ids.append(ids)
        prompt_texts.append(text)
    return prompt_ids, prompt_texts


def _record_turn(ep: _Episodes, st: _Settings, turn: int, act, prompts, out, infos, new_infos, rewards, dones, active):
    """Append the turn rows of the active episodes and update their episode state."""
    prompt_ids, prompt_texts = prompts
    for k, i in enumerate(act):
        resp = list(out.token_ids[k])
        lps = [float(x) for x in (out.logprobs[k] if out.logprobs else [0.0] * len(resp))]
        ep.counts["generated_tokens"] += len(resp)
        reason = out.finish_reasons[k] if out.finish_reasons else ("length" if len(resp) >= st.budget else "stop")
        was_cut = reason == "length" or len(resp) >= st.budget
        ep.counts["response_truncated"] += int(was_cut)
        if not resp:
            resp, lps = [st.eot_id], [0.0]
            ep.counts["empty_responses"] += 1
        info_before, info = infos[i], new_infos[i]
        ep.rows.append(
            _Row(
                episode=i,
                task=st.task_offset + i // st.group_n,
                rollout=i % st.group_n,
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
                truth=_truth(info_before),
            )
        )
        ep.reward[i] += float(rewards[i])
        ep.won[i] = ep.won[i] or bool(info.get("won", False))
        if info.get("failed", False):
            ep.failed[i] = True
        if dones[i] or ep.failed[i]:
            active[i] = False


def _play(env_manager, generator, tokenizer, tasks: Sequence, st: _Settings) -> _Episodes:
    """Reset ``len(tasks) * group_n`` episodes and step them until every one ends or the turn limit is reached."""
    t0 = time.perf_counter()
    obs, infos = env_manager.reset(list(tasks), group_n=st.group_n, seed=st.base_seed)
    n_ep = len(obs)
    if n_ep != len(tasks) * st.group_n:
        raise ValueError(f"env_manager: reset returned {n_ep} episodes, expected {len(tasks) * st.group_n}")
    ep = _Episodes(
        failed=[bool(info.get("failed", False)) for info in infos],
        reward=[0.0] * n_ep,
        won=[False] * n_ep,
        rows=[],
        counts=dict(prompt_truncated=0, response_truncated=0, empty_responses=0, generated_tokens=0),
        t_env=time.perf_counter() - t0,
    )
    active = [not f for f in ep.failed]
    limit = st.max_turns if st.max_turns is not None else max(int(i.get("max_steps") or 0) for i in infos) or 50
    turn = 0
    while turn < limit and any(active):
        act = [i for i in range(n_ep) if active[i]]
        prompts = _turn_prompts(tokenizer, obs, infos, act, turn, st, ep.counts)
        t1 = time.perf_counter()
        out = generator.generate(prompts[0], replace(st.sampling, seed=_seed(st.base_seed, "generate", turn)))
        ep.t_gen += time.perf_counter() - t1
        if len(out.token_ids) != len(act):
            raise ValueError(f"generator: returned {len(out.token_ids)} responses for {len(act)} prompts")
        responses: list[str | None] = [None] * n_ep
        for k, i in enumerate(act):
            responses[i] = out.texts[k]
        t2 = time.perf_counter()
        new_obs, rewards, dones, new_infos = env_manager.step(responses)
        ep.t_env += time.perf_counter() - t2
        _record_turn(ep, st, turn, act, prompts, out, infos, new_infos, rewards, dones, active)
        obs, infos = new_obs, new_infos
        turn += 1
        dt = time.perf_counter() - t0
        left = time_left(dt, turn, limit, bound=True) if any(active) else ""
        log.info(
            "rollout turn %d/%d: %d active, %d won, %.0fs%s",
            turn,
            limit,
            sum(active),
            sum(ep.won),
            dt,
            f", {left}" if left else "",
        )
    return ep


def _to_batch(rows: list[_Row], outcome: list[float], won: list[bool], st: _Settings) -> TurnBatch:
    width_r = max(len(r.response_ids) for r in rows)
    p_ids, p_mask = left_pad([r.prompt_ids for r in rows], st.max_prompt_length, st.pad_id)
    r_ids, r_mask = right_pad([r.response_ids for r in rows], width_r, st.pad_id)
    r_lp, _ = right_pad([r.logprobs for r in rows], width_r, 0.0, dtype=torch.float32)
    return TurnBatch(
        task=torch.tensor([r.task for r in rows], dtype=torch.long),
        rollout=torch.tensor([r.rollout for r in rows], dtype=torch.long),
        turn=torch.tensor([r.turn for r in rows], dtype=torch.long),
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        response_ids=r_ids,
        response_mask=r_mask,
        outcome=torch.tensor([outcome[r.episode] for r in rows], dtype=torch.float32),
        action_valid=torch.tensor([r.action_valid for r in rows], dtype=torch.bool),
        won=torch.tensor([won[r.episode] for r in rows], dtype=torch.bool),
        truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
        data_source=[r.data_source for r in rows],
        category=[r.category for r in rows],
        gamefile=[r.gamefile for r in rows],
        response_text=[r.response_text for r in rows],
        prompt_text=[r.prompt_text for r in rows],
        task_key=[r.task_key for r in rows],
        truth=[r.truth for r in rows] if any(r.truth is not None for r in rows) else [],
        rollout_logp=r_lp * r_mask,
    )


def _attach_teacher_prompts(batch: TurnBatch, rows: list[_Row], tokenizer, st: _Settings, skill_lookup) -> int:
    """Privileged teacher prompts of every row (§1.4); returns how many were left-truncated."""
    lookup = skill_lookup if skill_lookup is not None else env_skill_lookup(st.env_name)
    metas = [
        {
            **r.meta,
            "gamefile": r.gamefile,
            "data_source": r.data_source,
            "category": r.category,
            "task_key": r.task_key,
            "rollout": r.rollout,
        }
        for r in rows
    ]
    skills = [lookup(m) if lookup is not None else "" for m in metas]
    t_ids, t_mask, cut = build_teacher_prompts(
        tokenizer, batch.prompt_ids, batch.prompt_mask, skills, st.max_prompt_length, st.pad_id
    )
    start = int(t_mask.any(0).nonzero().min())  # drop the columns that are padding in every row
    batch.teacher_prompt_ids, batch.teacher_prompt_mask = t_ids[:, start:], t_mask[:, start:]
    return cut


def _rollout_metrics(batch, tasks, ep: _Episodes, outcome, st: _Settings, teacher_cut: int, dropped: int):
    episodes = [i for i in range(len(ep.failed)) if not (st.failed_episodes == "drop" and ep.failed[i])]
    lens = batch.response_mask.sum(1).float()
    cats: dict[str, list[bool]] = {}
    for i in episodes:
        cats.setdefault(str(getattr(tasks[i // st.group_n], "category", "") or "all"), []).append(ep.won[i])
    gen_tokens = ep.counts["generated_tokens"]
    metrics: dict[str, float] = {
        "turns": float(batch.size),
        "episodes": float(len(episodes)),
        "success_rate": (sum(ep.won[i] for i in episodes) / len(episodes)) if episodes else 0.0,
        "reward_mean": (sum(outcome[i] for i in episodes) / len(episodes)) if episodes else 0.0,
        "valid_action_rate": float(batch.action_valid.float().mean()),
        "response_length_mean": float(lens.mean()),
        "response_length_max": float(lens.max()),
        "prompt_length_mean": float(batch.prompt_mask.sum(1).float().mean()),
        "prompt_truncated": float(ep.counts["prompt_truncated"]),
        "teacher_prompt_truncated": float(teacher_cut),
        "response_truncated": float(ep.counts["response_truncated"]),
        "empty_responses": float(ep.counts["empty_responses"]),
        "failed_episodes": float(sum(ep.failed)),
        "dropped_rows": float(dropped),
        "generation_s": ep.t_gen,
        "environment_s": ep.t_env,
        "generated_tokens": float(gen_tokens),
        "generation_tokens_per_s": gen_tokens / ep.t_gen if ep.t_gen > 0 else 0.0,
    }
    for c, wins in sorted(cats.items()):
        metrics[f"success/{c}"] = sum(wins) / len(wins)
    return metrics


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
    student_skills: bool = False,
) -> TurnBatch:
    """Play ``len(tasks) * group_n`` episodes to the end and return their turn rows (see the module docstring).

    env_manager: an ``EnvManager`` (``reset(tasks, group_n, seed)``, ``step(responses)``). generator: a
    ``GenerationBackend``. tokenizer: the policy's tokenizer (chat template). sampling: the rollout's sampling
    settings; ``max_new_tokens`` is the per-turn response budget unless ``max_response_length`` is given.
    max_turns: turn limit (default: the manager's episode limit). truncation: "error" | "left" (default per
    environment, §1.3). teacher_prompts: also build the privileged teacher prompt of every row (§1.4), with
    ``skill_lookup(row_meta) -> skill text`` (default: the environments' skill bank for this environment; an
    environment without a skill bank gets the empty skill; the row's metadata also carries its sibling index
    ``rollout``). failed_episodes: "keep" (outcome 0) | "drop".
    task_offset: added to the task ids (distinct ids across data-parallel ranks). student_skills: put the skill
    block in front of the student's prompt too (the Skill-Prompt / Skill-GRPO baselines; ``skill_lookup`` or the
    environment's skill bank).
    """
    if not tasks:
        raise ValueError("tasks: expected a non-empty list of tasks")
    st = _check_settings(
        env_manager,
        generator,
        tokenizer,
        group_n=group_n,
        sampling=sampling,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
        max_turns=max_turns,
        seed=seed,
        validation=validation,
        truncation=truncation,
        failed_episodes=failed_episodes,
        task_offset=task_offset,
        pad_token_id=pad_token_id,
    )
    if student_skills:
        lookup = skill_lookup if skill_lookup is not None else env_skill_lookup(st.env_name)
        st.student_skills = lookup if lookup is not None else (lambda meta: "")
    ep = _play(env_manager, generator, tokenizer, tasks, st)
    outcome = [0.0 if ep.failed[i] else ep.reward[i] for i in range(len(ep.failed))]
    rows, dropped = ep.rows, 0
    if st.failed_episodes == "drop":
        rows = [r for r in ep.rows if not ep.failed[r.episode]]
        dropped = len(ep.rows) - len(rows)
    if not rows:
        raise ValueError("env_manager: the rollout produced no turn (every episode failed at reset or was dropped)")
    batch = _to_batch(rows, outcome, ep.won, st)
    teacher_cut = _attach_teacher_prompts(batch, rows, tokenizer, st, skill_lookup) if teacher_prompts else 0
    batch.extras["rollout_metrics"] = _rollout_metrics(batch, tasks, ep, outcome, st, teacher_cut, dropped)
    return batch
