"""One training step of ALGORITHM.md §4, for every estimator of the registry.

Legend: R = turn rows on this rank, M = canonical turns, L = response length, Lp / Lt = student / teacher
prompt length, P = cross pairs, D = embedding size.

    rollout (student sampling + environment)                       -> TurnBatch [R]
    canonical turns (§1.2)                                          -> Canonical (M turns, row weights 1/k)
    old log-probs (policy, fused head; entropy logged)              -> old_logp_RL
    reference log-probs when the KL coefficient is non-zero         -> ref_logp_RL
    [estimators that need the teacher]
      teacher generation from the privileged prompts (§2.1)
      parsing + thinking encoder (§1.5, §1.6)                       -> emb_MD (student, teacher), validity
      M1 selection: H, eligibility, top-K, action filter (§2.2-2.5) -> pairs_P2
      teacher forcing (diagonal + cross, shared prefixes) + rectify -> diag_ML, cross_PL, Rectified
    advantages: the estimator (GRPO, M2 credit, ...)                -> token advantage [M, L] + auxiliary terms
    PPO update over mini/micro-batches, exact global token-mean (§3.12), grad clip, AdamW
    weight sync to the generation engine

Only the phases the estimator declares are run (GRPO runs no teacher pass). Every phase is timed by the
step profiler (engine/profiler.py).

Robustness: a non-finite loss or gradient skips that optimiser step with a warning (weights unchanged);
a step whose advantages are all zero skips the update entirely (logged as ``update/skipped``); failing
environments and malformed outputs are counted by the rollout and never abort the step.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .batch import TurnBatch
from .config import RunConfig
from .profiler import StepProfiler

log = logging.getLogger("alignopsd.step")

# |advantage| below this everywhere (and no auxiliary term) means "no learnable signal": the update is skipped.
# Outcome normalisation of an all-equal group yields exact zeros, but the invalid-action residual of an
# all-invalid group leaves float32 noise of ~1e-8.
ZERO_ADVANTAGE_TOL = 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# components


@dataclass
class Components:
    """Everything a step needs, built once per run by :func:`build_components`."""

    cfg: RunConfig
    device: torch.device
    rank: int
    world_size: int
    tokenizer: Any
    policy: Any  # PolicyBackend (HFPolicy / Megatron)
    generator: Any  # GenerationBackend
    env: Any  # EnvManager
    train_tasks: list
    val_tasks: list
    estimator: Any
    rescorer: Any = None
    ref_scorer: Any = None
    encoder: Any = None
    teacher: Any = None
    profiler: StepProfiler = field(default_factory=StepProfiler)
    dp_group: Any = None  # data-parallel process group (None: the default group)
    audit: Any = None  # engine.audit.Auditor of the run (set by the trainer; None: no audit records)
    _encoder_factory: Any = None

    def get_encoder(self):
        if self.encoder is None and self._encoder_factory is not None:
            self.encoder = self._encoder_factory()
        return self.encoder

    def sync_weights(self) -> None:
        """Push the policy's weights to the generation engine and the rescoring copy (no-op when shared)."""
        hf = getattr(self.policy, "hf_model", None)
        state = None
        if hf is not None:  # Megatron backend: refresh the Hugging Face copy used for rescoring/generation
            state = self.policy.hf_state_dict()
            hf.load_state_dict(state, strict=False)
        gm = getattr(self.generator, "model", None)
        if gm is not None and gm is hf_model_of(self.policy):
            return
        self.generator.load_weights(state if state is not None else self.policy.hf_state_dict())

    def close(self) -> None:
        for obj in (self.env, self.generator):
            close = getattr(obj, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - shutdown must not mask the run's result
                    log.warning("close %s: %s", type(obj).__name__, exc)


def build_policy(cfg: RunConfig, device: torch.device):
    """Policy backend factory (``policy.backend``): hf | megatron.

    The Megatron backend trains a megatron-core GPTModel with tensor parallelism and scores old log-probs and
    teacher forcing with it (``backend_row_logprobs``); generation uses a Hugging Face copy of the same weights
    (``policy.hf_model``, pushed to vLLM when that is the engine), refreshed after every update by
    :meth:`Components.sync_weights`.
    """
    from .models import load_causal_lm

    model = load_causal_lm(
        cfg.model.name, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation, device=device
    )
    warmup = int(round(cfg.trainer.warmup_ratio * cfg.trainer.total_steps))
    if cfg.policy.backend == "megatron":
        from .policy.megatron.backend import MegatronPolicy

        policy = MegatronPolicy(
            model.config,
            model.state_dict(),
            tp=cfg.policy.tensor_parallel_size,
            lr=cfg.trainer.lr,
            weight_decay=cfg.trainer.weight_decay,
            betas=cfg.trainer.betas,
            params_dtype=model.dtype,
            seed=cfg.trainer.seed,
        )
        for p in model.parameters():
            p.requires_grad_(False)
        policy.hf_model = model
        return policy
    from .policy.hf import HFPolicy

    return HFPolicy(
        model,
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        betas=cfg.trainer.betas,
        warmup_steps=warmup,
        gradient_checkpointing=cfg.policy.gradient_checkpointing,
    )


def backend_row_logprobs(
    policy,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    row_prompt: Tensor,
    resp_ids: Tensor,
    resp_mask: Tensor,
    with_entropy: bool,
    *,
    temperature: float,
    device: torch.device,
    max_tokens: int = 16384,
) -> tuple[Tensor, Tensor | None]:
    """([R, L] log-probs, [R, L] entropy or None) of rows ``[prompt_ids[row_prompt] | resp_ids]`` scored by the policy
    backend itself, no grad, in row chunks of at most ``max_tokens`` token positions (the ``scorer`` of a
    :class:`~alignopsd.engine.rescoring.Rescorer`). Every tensor-parallel rank calls it with the same rows.

    prompt_ids/prompt_mask: [P, Lp] left-padded; row_prompt: [R] indices into them; resp_ids/resp_mask: [R, L]
    right-padded. Masked-out response positions get 0.
    """
    rows, length = int(resp_ids.shape[0]), int(resp_ids.shape[1])
    width = int(prompt_ids.shape[1]) + length
    per = max(1, max_tokens // max(1, width))
    rp = row_prompt.long().cpu()
    p_ids, p_mask = prompt_ids.cpu(), prompt_mask.cpu().long()
    r_ids, r_mask = resp_ids.cpu(), resp_mask.cpu().long()
    lps, ents = [], []
    for s in range(0, rows, per):
        idx = rp[s : s + per]
        ids = torch.cat([p_ids[idx], r_ids[s : s + per]], dim=1)
        attn = torch.cat([p_mask[idx], r_mask[s : s + per]], dim=1)
        lp, en = policy.response_logprobs(
            ids.to(device), attn.to(device), length, temperature=temperature, with_entropy=with_entropy, grad=False
        )
        lps.append(lp.float().cpu())
        if with_entropy:
            ents.append(en.float().cpu())
    lp = torch.cat(lps) if lps else torch.zeros(0, length)
    ent = (torch.cat(ents) if ents else torch.zeros(0, length)) if with_entropy else None
    out_dev = resp_ids.device
    return lp.to(out_dev) * resp_mask.float(), (ent.to(out_dev) * resp_mask.float() if ent is not None else None)


def hf_model_of(policy):
    """The Hugging Face module that generation and rescoring use (the policy's own, or its HF copy)."""
    return getattr(policy, "hf_model", None) or policy.model


def build_generator(cfg: RunConfig, policy, tokenizer, device: torch.device):
    """Generation backend factory (``generation.backend``): hf | vllm."""
    if cfg.generation.backend == "vllm":
        from .generation.vllm_backend import VLLMBackend

        return VLLMBackend.from_config(cfg, policy=policy, tokenizer=tokenizer)
    from .generation.hf import HFGenerator

    return HFGenerator(hf_model_of(policy), tokenizer)


def build_components(cfg: RunConfig, *, device: torch.device, rank: int = 0, world_size: int = 1) -> Components:
    from alignopsd.estimators import get_estimator

    from .envs.manager import EnvManager
    from .models import load_tokenizer
    from .rescoring import Rescorer

    est = get_estimator(cfg.algorithm.estimator)
    phases = est.phases(cfg.algorithm)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    policy = build_policy(cfg, device)
    generator = build_generator(cfg, policy, tokenizer, device)
    env = EnvManager(
        cfg.env.name,
        num_workers=cfg.env.workers,
        step_timeout=cfg.env.step_timeout_s,
        history_length=cfg.env.history_length,
        max_steps=cfg.env.max_turns,
        **({"data_dir": cfg.env.data_dir} if cfg.env.data_dir else {}),
        **cfg.env.options,
    )
    seed = cfg.trainer.seed
    pool = {"pool_size": cfg.env.num_games} if (cfg.env.name == "alfworld" and not cfg.env.data_dir) else {}
    train_tasks = env.task_source(cfg.env.split, n=cfg.env.num_games, seed=seed, **pool)
    val_pool = {"pool_size": cfg.env.val_tasks} if pool else {}
    val_tasks = env.task_source(cfg.env.val_split, n=cfg.env.val_tasks, seed=seed, **val_pool)
    rescorer = Rescorer(
        hf_model_of(policy),
        mode=cfg.trainer.rescoring_mode,
        temperature=cfg.generation.temperature,
        reuse_rollout_logp=cfg.trainer.logprob_reuse,
        # a policy trained apart from its Hugging Face copy (Megatron) scores the rows itself, old log-probs and
        # teacher forcing alike: the first PPO ratio compares the trained model with itself and the evidence
        # (teacher minus student) compares two forwards of one implementation (plain rows, no prefix sharing)
        scorer=(
            functools.partial(backend_row_logprobs, policy, temperature=cfg.generation.temperature, device=device)
            if getattr(policy, "hf_model", None) is not None
            else None
        ),
    )
    ref_scorer = None
    if phases["ref"]:
        from .models import load_causal_lm

        ref_model = load_causal_lm(cfg.model.name, dtype=cfg.model.dtype, device=device)
        for p in ref_model.parameters():
            p.requires_grad_(False)
        ref_scorer = Rescorer(ref_model, mode="plain", temperature=cfg.generation.temperature)

    def encoder_factory():
        from .encoder import MINILM, ThinkingEncoder

        name = cfg.encoder.name
        if name.lower() in ("minilm", MINILM):
            name = MINILM
        elif not Path(name).expanduser().is_dir():
            from .models import resolve_model_path

            name = resolve_model_path(name)  # a Hugging Face id already in the local cache
        return ThinkingEncoder(
            name, max_length=cfg.encoder.max_length, batch_size=cfg.encoder.batch_size, device=device
        )

    dp_group = getattr(policy, "dp_group", None)
    if dp_group is not None:  # tensor parallelism: ranks of one TP group play the same tasks
        import torch.distributed as dist

        rank, world_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    return Components(
        dp_group=dp_group,
        cfg=cfg,
        device=device,
        rank=rank,
        world_size=world_size,
        tokenizer=tokenizer,
        policy=policy,
        generator=generator,
        env=env,
        train_tasks=train_tasks,
        val_tasks=val_tasks,
        estimator=est,
        rescorer=rescorer,
        ref_scorer=ref_scorer,
        _encoder_factory=encoder_factory if phases["alignment"] else None,
    )


# ---------------------------------------------------------------------------------------------------------------------
# task sampling (deterministic in (seed, step, rank): the data position of a checkpoint is the step)


def tasks_for_step(tasks: list, step: int, n: int, seed: int, rank: int = 0, world_size: int = 1) -> list:
    """The ``n`` tasks of training step ``step`` (epoch-wise seeded permutation), this rank's share."""
    import random as _random

    if not tasks:
        raise ValueError("tasks: the task source is empty")
    total = len(tasks)
    start = step * n
    out = []
    for k in range(start, start + n):
        epoch, pos = divmod(k, total)
        perm = list(range(total))
        _random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.append(tasks[perm[pos]])
    per = n // world_size
    return out[rank * per : (rank + 1) * per]


# ---------------------------------------------------------------------------------------------------------------------
# the step


@dataclass
class StepOutput:
    metrics: dict[str, float]
    span_lengths: list[int] = field(default_factory=list)


def run_step(parts: Components, step: int) -> StepOutput:
    """One training step (see the module docstring). ``step`` is 0-based."""
    cfg = parts.cfg
    prof = parts.profiler
    prof.start_step()
    metrics: dict[str, float] = {}

    # 1. rollout -------------------------------------------------------------------------------------------------
    tasks = tasks_for_step(
        parts.train_tasks, step, cfg.env.tasks_per_step, cfg.trainer.seed, parts.rank, parts.world_size
    )
    batch, roll_metrics = rollout(parts, tasks, seed=_step_seed(cfg, step, parts.rank), validation=False)
    metrics.update(roll_metrics)

    # no learnable signal (every task's outcomes and validity constant, no auxiliary term): skip the rest cheaply
    skip = cfg.trainer.skip_no_signal and no_signal(cfg, parts.estimator, batch)
    if parts.world_size > 1:  # one collective on every rank: skip only if all ranks agree
        skip = all_reduce([float(skip)], "min", parts.world_size, getattr(parts, "dp_group", None))[0] == 1.0
    if skip:
        log.info("step %d: no learnable signal (constant outcomes per task); update skipped", step)
        metrics.update({"update/skipped": 1.0, "update/zero_advantage": 1.0, "actor/loss": 0.0})
        if parts.audit is not None:
            metrics.update(parts.audit.record_skipped(step + 1, batch.size))
        metrics.update(prof.end_step())
        return StepOutput(metrics=metrics)

    # 2. canonical turns ---------------------------------------------------------------------------------------------
    from alignopsd.canonical import canonicalize

    canon = canonicalize(batch.task.tolist(), batch.rollout.tolist(), batch.turn.tolist())
    cb = batch.select(canon.first_row)  # canonical batch, M rows in identity order
    metrics["batch/rows"] = float(batch.size)
    metrics["batch/turns"] = float(cb.size)

    # 3. old log-probs -------------------------------------------------------------------------------------------
    with prof.phase("old_logprob"):
        out = parts.rescorer(cb, student=True, teacher=False, with_entropy=True)
        old_logp = out.old_logp
        mask = cb.response_mask.bool()
        if out.entropy is not None:
            metrics["actor/entropy_old"] = _masked_mean(out.entropy, mask)
        for k, v in out.stats.items():
            if isinstance(v, (int, float)) and "diff" in k:
                metrics[f"rollout/{k.split('/')[-1]}"] = float(v)

    # 4. reference log-probs -------------------------------------------------------------------------------------
    ref_logp = None
    if parts.ref_scorer is not None:
        with prof.phase("reference"):
            ref_logp = parts.ref_scorer(cb, student=True, teacher=False).old_logp

    # 5. teacher + M1 (only what the estimator declares) ---------------------------------------------------------
    phases = parts.estimator.phases(cfg.algorithm)
    m1 = None
    if phases["alignment"]:
        m1 = mechanism1(parts, cb, metrics)
    elif phases["teacher_diag"]:
        m1 = teacher_diagonal(parts, cb)

    # 6. advantages ----------------------------------------------------------------------------------------------
    est_out, span_lengths = estimate(parts, cb, old_logp, m1, step, metrics)
    regions = response_regions(parts, cb) if parts.audit is not None else None  # shared by both users
    if est_out.rectified is not None:
        metrics.update(region_metrics(parts, cb, old_logp, est_out.rectified, regions))
    adv_ML = est_out.token_advantage
    aux_terms = est_out.aux
    metrics["adv/token_advantage_abs_mean"] = _masked_mean(adv_ML.abs(), cb.response_mask)

    # audit records (§4.3 "Audit"): reads the step's tensors, draws no random numbers, never raises
    if parts.audit is not None:
        metrics.update(parts.audit.record(step + 1, cb, canon.counts, old_logp, adv_ML, est_out, m1, regions))

    # 7. update --------------------------------------------------------------------------------------------------
    with prof.phase("update"):
        upd = ppo_update(parts, cb, old_logp, ref_logp, adv_ML, canon_row_weight(canon, cb), aux_terms)
    metrics.update(upd)

    # 8. weight sync ---------------------------------------------------------------------------------------------
    if not upd.get("update/skipped", 0.0):
        with prof.phase("weight_sync"):
            parts.sync_weights()
    metrics.update(prof.end_step())
    return StepOutput(metrics=metrics, span_lengths=span_lengths)


AUX_FREE = ("grpo", "rlsd", "grpo_opsd", "alignopsd")  # estimators whose advantage is A * (positive weights)


def no_signal(cfg: RunConfig, spec, batch: TurnBatch) -> bool:
    """True when every token advantage is provably 0 before any model pass: the estimator has no auxiliary
    term, each task's outcomes are equal (A = 0, and M2 only re-weights A) and, with the invalid-action
    penalty on, each task's validity flags are equal too (residual 0)."""
    a = cfg.algorithm
    if spec.name not in AUX_FREE or (spec.name == "alignopsd" and a.sdar.enabled):
        return False
    for t in batch.task.unique():
        sel = batch.task == t
        if bool((batch.outcome[sel] != batch.outcome[sel][0]).any()):
            return False
        if a.use_invalid_penalty and bool((batch.action_valid[sel] != batch.action_valid[sel][0]).any()):
            return False
    return True


def _step_seed(cfg: RunConfig, step: int, rank: int) -> int:
    return (cfg.trainer.seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**31 - 1)


def canon_row_weight(canon, cb: TurnBatch) -> Tensor:
    """[M] weight of each canonical row: a turn with k rows carries one unit of mass in total (§1.2)."""
    # the canonical batch holds one row per turn, so each has weight k * (1/k) = 1
    return torch.ones(cb.size, dtype=torch.float32)


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    m = mask.bool()
    return float(x[m].float().mean()) if bool(m.any()) else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# rollout


def rollout(parts: Components, tasks: list, *, seed: int, validation: bool) -> tuple[TurnBatch, dict[str, float]]:
    """Collect the turn batch of ``tasks`` (G siblings each, or 1 in validation) and its episode metrics."""
    from .rollout import collect_rollouts

    cfg = parts.cfg
    prof = parts.profiler
    phases = parts.estimator.phases(cfg.algorithm)
    env_before = parts.env.metrics()
    per = cfg.env.tasks_per_step // parts.world_size
    with prof.phase("rollout_generation"):
        batch = collect_rollouts(
            parts.env,
            parts.generator,
            parts.tokenizer,
            tasks,
            group_n=cfg.env.group_n,
            sampling=_sampling(cfg, validation),
            max_prompt_length=cfg.env.max_prompt_length,
            max_turns=cfg.env.max_turns,
            seed=seed,
            validation=validation,
            teacher_prompts=(not validation) and (phases["alignment"] or phases["teacher_diag"]),
            task_offset=parts.rank * per,
        )
    rm = batch.extras.get("rollout_metrics", {})
    prof.move("rollout_generation", "environment", float(rm.get("environment_s", 0.0)))
    env_after = parts.env.metrics()
    metrics = episode_metrics(parts.env.episode_results(), batch)
    for k in ("prompt_truncated", "teacher_prompt_truncated", "response_truncated", "empty_responses",
              "generation_tokens_per_s", "prompt_length_mean"):  # fmt: skip
        if k in rm:
            metrics[f"rollout/{k}"] = float(rm[k])
    for k in ("failed_episodes", "env_errors", "timeouts", "worker_deaths", "invalid_actions"):
        metrics[f"env/{k}"] = float(env_after.get(k, 0) - env_before.get(k, 0))
    return batch, metrics


def _sampling(cfg: RunConfig, validation: bool):
    from .generation.base import SamplingParams

    g = cfg.generation
    stop = ("</action>", "</search>", "</answer>")
    return SamplingParams(
        max_new_tokens=g.max_response_length,
        temperature=g.val_temperature if validation else g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        do_sample=g.val_do_sample if validation else g.do_sample,
        stop=stop,
    )


def episode_metrics(results: list[dict], batch: TurnBatch | None) -> dict[str, float]:
    """Reward, success, per-category success, valid-action rate, response lengths of one batch of episodes."""
    out: dict[str, float] = {}
    n = len(results)
    out["episode/count"] = float(n)
    if n:
        out["episode/reward_mean"] = sum(r["reward"] for r in results) / n
        out["episode/success_rate"] = sum(bool(r["won"]) for r in results) / n
        out["episode/turns_mean"] = sum(r["steps"] for r in results) / n
        out["episode/failed_count"] = float(sum(bool(r.get("failed")) for r in results))
        scores = [r["task_score"] for r in results if r.get("task_score") is not None]
        if scores:
            out["episode/task_score_mean"] = sum(float(s) for s in scores) / len(scores)
        cats: dict[str, list[bool]] = {}
        for r in results:
            cats.setdefault(str(r.get("category") or "all"), []).append(bool(r["won"]))
        for c, wins in sorted(cats.items()):
            out[f"episode/success/{c}"] = sum(wins) / len(wins)
        srcs: dict[str, list[bool]] = {}
        for r in results:
            srcs.setdefault(str(r.get("data_source") or "text"), []).append(bool(r["won"]))
        if len(srcs) > 1 or "text" not in srcs:
            for s, wins in sorted(srcs.items()):
                out[f"episode/accuracy/{s}"] = sum(wins) / len(wins)
    if batch is not None and batch.size:
        out["episode/valid_action_rate"] = float(batch.action_valid.float().mean())
        lens = batch.response_mask.long().sum(1).float()
        out["rollout/response_length_mean"] = float(lens.mean())
        out["rollout/response_length_max"] = float(lens.max())
        if batch.truncated is not None:
            out["rollout/truncated_rate"] = float(batch.truncated.float().mean())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Mechanism 1 (teacher generation, encoding, selection, teacher forcing, rectification)


@dataclass
class M1Result:
    """Mechanism 1 inputs of the estimator (rectification itself runs inside the estimator)."""

    H: Tensor | None = None  # [M, M] similarity [source, target]
    eligible: Tensor | None = None  # [M, M] bool
    pairs: Tensor | None = None  # [P, 2] (source, target), grouped by target in rank order
    diag: Tensor | None = None  # [M, L] diagonal teacher log-probs
    cross: Tensor | None = None  # [P, L] cross log-probs in pair order
    student_thinking_valid: Tensor | None = None  # [M] bool
    teacher_thinking_valid: Tensor | None = None  # [M] bool


def teacher_diagonal(parts: Components, cb: TurnBatch) -> M1Result:
    """Diagonal teacher forcing only (estimators with ``needs_teacher_diag`` but no alignment)."""
    with parts.profiler.phase("teacher_forcing"):
        diag, _, _ = parts.rescorer.teacher_logprobs(cb, None)
    return M1Result(diag=diag)


def mechanism1(parts: Components, cb: TurnBatch, metrics: dict[str, float]) -> M1Result:
    """Teacher generation, parsing, encoding, selection (+ action filter) and teacher forcing (§2.1-2.6)."""
    from alignopsd import action_filter, eligibility, select_sources
    from alignopsd.diagnostics import action_filter_metrics
    from alignopsd.rectify import pairs_from_selection, similarity_matrix

    from .envs.parsing import parse_action, parse_thinking

    cfg = parts.cfg
    prof = parts.profiler
    rc = cfg.algorithm.rectify
    use_filter = bool(rc.action_filter)

    with prof.phase("teacher_generation"):
        teacher_texts, tstats = teacher_generate(parts, cb, stop_after_action=use_filter)
    metrics.update({f"m1/{k}": float(v) for k, v in tstats.items()})

    with prof.phase("encoding"):
        s_think = [parse_thinking(t) for t in cb.response_text]
        t_think = [parse_thinking(t) for t in teacher_texts]
        texts = [t for t, _ in s_think] + [t for t, _ in t_think]
        if use_filter:
            t_act = [parse_action(t) for t in teacher_texts]
            s_act = [parse_action(t) for t in cb.response_text]
            texts += [a for a, _, _ in t_act] + [a for a, _, _ in s_act]
        emb, valid = _encode(parts.get_encoder(), texts)
    m = cb.size
    s_valid = valid[:m] & torch.tensor([v for _, v in s_think], dtype=torch.bool)
    t_valid = valid[m : 2 * m] & torch.tensor([v for _, v in t_think], dtype=torch.bool)
    metrics["m1/invalid_student_thinking_fraction"] = float((~s_valid).float().mean()) if m else 0.0
    metrics["m1/invalid_teacher_thinking_fraction"] = float((~t_valid).float().mean()) if m else 0.0

    with prof.phase("m1_selection"):
        task, roll, turn = cb.task, cb.rollout, cb.turn
        H = similarity_matrix(emb[m : 2 * m], emb[:m], task)
        B = eligibility(task, roll, t_valid, s_valid)
        selected = select_sources(H, B, task, roll, turn, gamma=float(rc.gamma), top_k=int(rc.top_k))
        if use_filter:
            ta_valid = valid[2 * m : 3 * m] & torch.tensor([v for _, v, _ in t_act], dtype=torch.bool)
            sa_valid = valid[3 * m :] & torch.tensor([v for _, v, _ in s_act], dtype=torch.bool)
            A = (emb[2 * m : 3 * m] @ emb[3 * m :].T).clamp(-1, 1)
            before = selected
            selected = action_filter(
                selected,
                A,
                ta_valid,
                sa_valid,
                threshold=float(rc.action_threshold),
                source_actions=[a for a, _, _ in t_act],
                target_actions=[a for a, _, _ in s_act],
                webshop=cfg.env.name.lower() == "webshop",
            )
            metrics.update(action_filter_metrics(before, selected, enabled=True, threshold=float(rc.action_threshold)))
            metrics["m1/invalid_student_action_fraction"] = float((~sa_valid).float().mean()) if m else 0.0
            metrics["m1/invalid_teacher_action_fraction"] = float((~ta_valid).float().mean()) if m else 0.0
        pairs = pairs_from_selection(selected)

    with prof.phase("teacher_forcing"):  # diagonal + cross rows in one fused scoring batch (§2.6)
        diag, cross, st = parts.rescorer.teacher_logprobs(cb, pairs)
    metrics["m1/teacher_forcing_row_count"] = float(m + pairs.shape[0])
    for k in ("token_forwards", "forwards"):
        if k in st:
            metrics[f"m1/teacher_forcing_{k}"] = float(st[k])
    return M1Result(H, B, pairs, diag, cross, s_valid, t_valid)


def _encode(encoder, texts: list[str]) -> tuple[Tensor, Tensor]:
    out = encoder.encode(texts)
    if isinstance(out, tuple):
        emb, valid = out
    else:
        emb = out
        valid = emb.norm(dim=-1) > 0
    return emb.float().cpu(), torch.as_tensor(valid, dtype=torch.bool).cpu()


def teacher_generate(parts: Components, cb: TurnBatch, *, stop_after_action: bool) -> tuple[list[str], dict]:
    """One teacher response per canonical turn from its privileged prompt (prompt part only), §2.1.

    Only the thinking (and, with the action filter, the action) is used, so generation stops at the
    closing think (or action) tag; the text up to there is what the full budget would have produced.
    """
    from .generation.base import SamplingParams

    cfg = parts.cfg
    g = cfg.generation
    if cb.teacher_prompt_ids is None or cb.teacher_prompt_mask is None:
        raise ValueError("batch: the rollout produced no teacher prompts (teacher_prompt_ids is None)")
    prompts = [
        [t for t, k in zip(ids, msk) if k]
        for ids, msk in zip(cb.teacher_prompt_ids.tolist(), cb.teacher_prompt_mask.tolist())
    ]
    sampling = SamplingParams(
        max_new_tokens=cfg.teacher_budget,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        do_sample=g.do_sample,
        stop=("</action>", "</search>", "</answer>") if stop_after_action else ("</think>",),
    )
    out = parts.generator.generate(prompts, sampling)
    lens = [len(t) for t in out.token_ids]
    n = max(1, len(lens))
    stats = {
        "teacher_output_budget": float(cfg.teacher_budget),
        "teacher_response_length_mean": sum(lens) / n,
        "teacher_response_at_budget_fraction": sum(x >= cfg.teacher_budget for x in lens) / n,
        "teacher_tokens_saved": float(sum(max(0, cfg.teacher_budget - x) for x in lens)),
    }
    return list(out.texts), stats


def response_regions(parts: Components, cb: TurnBatch):
    """Thinking/action token regions of the canonical responses (engine/regions.py); None if they fail."""
    from .regions import token_regions

    try:
        return token_regions(cb.response_ids, cb.response_mask, parts.tokenizer)
    except Exception as exc:  # noqa: BLE001 - diagnostics never abort a step
        log.warning("token regions failed: %s", exc)
        return None


def region_metrics(parts: Components, cb: TurnBatch, old_logp: Tensor, rect, reg=None) -> dict[str, float]:
    """Thinking/action regions and the paired statistics per region (§4.3); never aborts a step.

    ``reg``: the regions when already found (:func:`response_regions`), else they are found here."""
    from .regions import paired_region_stats, region_token_counts, token_regions

    out: dict[str, float] = {}
    try:
        if reg is None:
            reg = token_regions(cb.response_ids, cb.response_mask, parts.tokenizer)
        out.update({f"regions/{k}": float(v) for k, v in reg.counts.items()})
        pm = cb.response_mask
        for k, v in region_token_counts(reg, pm).items():
            out[f"regions/{k}_token_count"] = float(v)
        if rect is not None:
            old = old_logp.float()
            gaps = (rect.diag - old, rect.cross_score - old, rect.corrected - old)
            out.update(paired_region_stats(*gaps, pm, reg, rect.matched))
    except Exception as exc:  # noqa: BLE001 - diagnostics never abort a step
        log.warning("region diagnostics failed: %s", exc)
        out["regions/errors"] = 1.0
    return out


# ---------------------------------------------------------------------------------------------------------------------
# advantages


def estimate(parts: Components, cb: TurnBatch, old_logp: Tensor, m1: M1Result | None, step: int, metrics: dict):
    """Run the configured estimator; returns (EstimatorOutput, span lengths of the M2 segments)."""
    from alignopsd.estimators import EstimatorInputs

    spec = parts.estimator
    phases = spec.phases(parts.cfg.algorithm)
    m1 = m1 or M1Result()
    inputs = EstimatorInputs(
        old_logp=old_logp,
        mask=cb.response_mask.bool(),
        outcome=cb.outcome.float(),
        task=cb.task,
        rollout=cb.rollout,
        turn=cb.turn,
        invalid=~cb.action_valid.bool(),
        diag=m1.diag,
        cross=m1.cross,
        pairs=m1.pairs,
        H=m1.H,
        eligible=m1.eligible,
        step=step,
    )
    with parts.profiler.phase("m2" if phases["mechanism2"] else "advantage"):
        out = spec(inputs, parts.cfg.algorithm)
    metrics.update({k: float(v) for k, v in out.metrics.items() if isinstance(v, (int, float))})
    spans: list[int] = []
    if out.credit is not None:
        seg = getattr(out.credit, "segment_index", None)
        if seg is not None:
            seg = torch.as_tensor(seg)
            ids = seg[seg >= 0]
            if ids.numel():
                spans = torch.bincount(ids).tolist()
                spans = [int(x) for x in spans if x > 0]
    return out, spans


@dataclass
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 3.0
    entropy_coef: float = 0.001
    kl_coef: float = 0.0


def loss_settings(cfg: RunConfig) -> LossSettings:
    """PPO / entropy / KL coefficients of the algorithm config (§3.12)."""
    a = cfg.algorithm
    return LossSettings(
        clip_low=float(a.clip_low),
        clip_high=float(a.clip_high),
        dual_clip=float(a.dual_clip),
        entropy_coef=float(a.entropy_coef),
        kl_coef=float(a.kl_coef),
    )


def _split(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def ppo_update(
    parts: Components,
    cb: TurnBatch,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv_ML: Tensor,
    row_weight: Tensor,
    aux_terms: list,
) -> dict[str, float]:
    """PPO over mini- and micro-batches with the exact global weighted token-mean of §3.12.

    Each rank splits its M rows into the same number of mini-batches (the maximum over ranks) and each
    mini-batch into the same number of micro-batches, padding with zero-weight rows, so data-parallel
    gradient averaging stays in lock-step. Micro-batch loss = token-mean x (its weighted tokens / D),
    D = (all ranks' weighted tokens of the mini-batch) / world size.
    """
    from alignopsd.losses import auxiliary_loss, entropy_bonus, low_var_kl, ppo_loss, token_mean

    cfg = parts.cfg
    ls = loss_settings(cfg)
    policy = parts.policy
    mask = cb.response_mask.float()
    adv_ML = adv_ML.float() * mask
    m, length = cb.size, cb.response_length
    world = parts.world_size
    out: dict[str, float] = {}

    # nothing to learn: zero advantages and no auxiliary term (checked on all ranks)
    signal = float(adv_ML.abs().max()) if adv_ML.numel() else 0.0
    signal = max(signal, max((float(a.coef) for a in aux_terms), default=0.0))
    if (
        cfg.trainer.skip_no_signal
        and all_reduce([signal], "max", world, getattr(parts, "dp_group", None))[0] <= ZERO_ADVANTAGE_TOL
    ):
        log.info("step skipped: all advantages are zero and no auxiliary term is active")
        return {"update/skipped": 1.0, "update/zero_advantage": 1.0, "actor/loss": 0.0}

    mini = max(1, cfg.trainer.ppo_mini_batch_size // world)
    micro = max(1, cfg.trainer.ppo_micro_batch_size)
    fused = bool(cfg.trainer.fused_head_loss and getattr(policy, "supports_fused_loss", False))
    probed = False
    minis = _split(m, mini)
    n_mini = int(all_reduce([float(len(minis))], "max", world, getattr(parts, "dp_group", None))[0])
    input_ids, attn = cb.input_ids().to(parts.device), cb.attention_mask().to(parts.device)
    totals: dict[str, float] = {}
    n_opt, skipped, grad_norms = 0, 0, []
    for i in range(n_mini):
        rows = minis[i] if i < len(minis) else []
        micros = _split(len(rows), micro)
        n_micro = int(all_reduce([float(len(micros))], "max", world, getattr(parts, "dp_group", None))[0])
        w_tok = [
            float((mask[[rows[j] for j in mc]] * row_weight[[rows[j] for j in mc]][:, None]).sum()) for mc in micros
        ]
        global_tok = all_reduce([sum(w_tok)], "sum", world, getattr(parts, "dp_group", None))[0]
        if global_tok <= 0:
            continue
        denom = global_tok / world
        for j in range(n_micro):
            idx = [rows[k] for k in micros[j]] if j < len(micros) else []
            scale = (w_tok[j] / denom) if j < len(micros) else 0.0
            dummy = not idx
            if dummy:  # keep data-parallel ranks in lock-step: one zero-weight row
                idx = [0]
            ix = torch.tensor(idx, dtype=torch.long)
            w = row_weight[ix].clone() if not dummy else torch.zeros(1)
            if float(w.sum()) == 0.0:
                w = torch.zeros_like(w)
            mk = mask[ix]
            last = j == n_micro - 1
            ctx = policy.no_sync() if (hasattr(policy, "no_sync") and not last) else _null()
            with ctx:
                wt = w if float(w.sum()) > 0 else torch.ones_like(w)  # token_mean needs a positive denominator

                def micro_loss(logp_bl, ent_bl, ix=ix, mk=mk, wt=wt):
                    """The micro-batch loss (§3.12) from [b, L] log-probs / entropies: (loss, logged terms)."""
                    logp_bl = logp_bl.float().cpu() if logp_bl.device.type != "cpu" else logp_bl.float()
                    pg, st = ppo_loss(logp_bl, old_logp[ix], adv_ML[ix], mk, clip_low=ls.clip_low,
                                      clip_high=ls.clip_high, dual_clip=ls.dual_clip, row_weight=wt)  # fmt: skip
                    loss = pg
                    terms = {"actor/pg_loss": pg.detach()}
                    if ls.entropy_coef > 0 and ent_bl is not None:
                        eb = entropy_bonus(ent_bl.float().cpu(), mk, coef=ls.entropy_coef, row_weight=wt)
                        loss = loss + eb
                        terms["actor/entropy"] = -eb.detach() / ls.entropy_coef
                    if ls.kl_coef != 0 and ref_logp is not None:
                        kl = token_mean(low_var_kl(logp_bl, ref_logp[ix]), mk, wt)
                        loss = loss + ls.kl_coef * kl
                        terms["actor/kl"] = kl.detach()
                    for term in aux_terms:
                        a, ast = auxiliary_loss(term, logp_bl, mk, rows=ix, row_weight=wt)
                        loss = loss + a
                        terms.update({(k if "/" in k else f"{term.kind}/{k}"): v for k, v in ast.items()})
                    terms.update({f"actor/{k}": v for k, v in st.items()})
                    return loss, terms

                with_ent = ls.entropy_coef > 0
                if fused and not probed:  # once per update, on every rank: the fused path needs a separable loss
                    probed = True
                    sep = loss_is_separable(lambda lp, en, f=micro_loss: f(lp, en)[0], old_logp[ix], mk, with_ent)
                    if all_reduce([0.0 if sep else 1.0], "max", world, getattr(parts, "dp_group", None))[0] > 0:
                        fused = False
                        log.warning(
                            "the policy loss couples tokens (not a sum of per-token terms): this update uses autograd "
                            "through the log-prob head instead of the fused head loss"
                        )
                if fused:
                    # the head's gradients are formed with the log-probs (three matmuls instead of four)
                    logp, ent, carrier = policy.response_loss(
                        input_ids[ix], attn[ix], length, lambda lp_bl, en_bl: micro_loss(lp_bl, en_bl)[0],
                        loss_fill=old_logp[ix], temperature=cfg.generation.temperature, with_entropy=with_ent,
                    )  # fmt: skip
                else:
                    logp, ent = policy.response_logprobs(
                        input_ids[ix], attn[ix], length, temperature=cfg.generation.temperature,
                        with_entropy=with_ent, grad=True,
                    )  # fmt: skip
                logp = logp.float().cpu() if logp.device.type != "cpu" else logp.float()
                if not bool(torch.isfinite(logp[mk.bool()]).all()):
                    # NaN gradients make the optimiser step skip (on every rank, through the all-reduce)
                    log.warning("non-finite log-probs in mini-batch %d: the optimiser step will be skipped", i)
                    out["update/nonfinite_loss"] = out.get("update/nonfinite_loss", 0.0) + 1.0
                    ((carrier if fused else logp.sum()) * float("nan")).backward()
                    continue
                if fused:
                    with torch.no_grad():
                        loss, terms = micro_loss(logp, ent)
                    backward_of = carrier
                else:
                    loss, terms = micro_loss(logp, ent)
                    backward_of = loss
                terms = {k: float(v) for k, v in terms.items()}
                if not torch.isfinite(loss):
                    log.warning("non-finite loss (%s) in mini-batch %d: the optimiser step will be skipped", loss, i)
                    out["update/nonfinite_loss"] = out.get("update/nonfinite_loss", 0.0) + 1.0
                    if fused:
                        backward_of = carrier * float("nan")
                (backward_of * scale).backward()
            if not dummy:
                for k, v in terms.items():
                    totals[k] = totals.get(k, 0.0) + v * scale / n_mini
                totals["actor/loss"] = totals.get("actor/loss", 0.0) + float(loss.detach()) * scale / n_mini
        res = policy.optimizer_step(cfg.trainer.grad_clip)
        n_opt += 1
        skipped += int(bool(res.get("skipped")))
        grad_norms.append(float(res.get("grad_norm", 0.0)))
        out["actor/lr"] = float(res.get("lr", cfg.trainer.lr))
    out.update(totals)
    finite = [g for g in grad_norms if math.isfinite(g)]
    out["actor/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
    out["update/fused_head_loss"] = 1.0 if fused else 0.0
    out["update/optimizer_steps"] = float(n_opt)
    out["update/skipped_optimizer_steps"] = float(skipped)
    out["update/skipped"] = 1.0 if n_opt and skipped == n_opt else 0.0
    return out


def loss_is_separable(loss_fn, fill_BL: Tensor, mask_BL: Tensor, with_entropy: bool) -> bool:
    """Whether ``loss_fn(logp_BL, ent_BL) -> scalar`` behaves as a sum of per-token terms around ``fill_BL``.

    A deterministic probe (no random numbers): the gradient at every other masked token must not move when the
    remaining masked tokens' log-probs (and entropies) move. A token-mean of per-token terms passes; a loss with a
    sequence-level ratio or a normaliser computed from log-probs fails. It is a probe, not a proof: a coupling
    that the shift does not reach goes unseen.
    """
    flat = mask_BL.bool().reshape(-1)
    idx = flat.nonzero().squeeze(1)
    if idx.numel() < 2:
        return True
    probe = torch.zeros_like(flat)
    probe[idx[0::2]] = True
    other = torch.zeros_like(flat)
    other[idx[1::2]] = True
    shift = 0.37 * torch.cos(torch.arange(flat.numel(), dtype=torch.float32)) * other
    base = fill_BL.detach().float().reshape(-1).cpu()

    def probe_grads(lp_flat: Tensor, ent_flat: Tensor) -> list[Tensor]:
        lp = lp_flat.reshape(fill_BL.shape).clone().requires_grad_(True)
        leaves = [lp]
        en = None
        if with_entropy:
            en = ent_flat.reshape(fill_BL.shape).clone().requires_grad_(True)
            leaves.append(en)
        with torch.enable_grad():
            grads = torch.autograd.grad(loss_fn(lp, en), leaves, allow_unused=True)
        return [(g if g is not None else torch.zeros_like(x)).reshape(-1)[probe] for g, x in zip(grads, leaves)]

    zeros = torch.zeros_like(base)
    before = probe_grads(base, zeros)
    after = probe_grads(base + shift, zeros + shift.abs())
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(before, after))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_validation(parts: Components, step: int) -> dict[str, float]:
    """Validation pass on held-out tasks: group size 1, validation temperature, own seeds; no update."""
    cfg = parts.cfg
    per = len(parts.val_tasks) // parts.world_size
    tasks = parts.val_tasks[parts.rank * per : (parts.rank + 1) * per] or parts.val_tasks[:1]
    prof = StepProfiler()
    saved, parts.profiler = parts.profiler, prof
    prof.start_step()
    try:
        _, metrics = rollout(parts, tasks, seed=_step_seed(cfg, 10_000_000 + step, parts.rank), validation=True)
    finally:
        parts.profiler = saved
    return metrics


def all_reduce(values: list[float], op: str, world_size: int, group=None) -> list[float]:
    """All-reduce a few floats across data-parallel ranks (identity when single-process)."""
    if world_size <= 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(t, op=red, group=group)
    return t.cpu().tolist()
