"""Mechanism 1's engine side (ALGORITHM.md §2.1-2.6): teacher generation, encoding, selection, teacher forcing.

Legend: M = canonical turns, L = response length, P = cross pairs, D = embedding size.

    teacher generation from the privileged prompts (§2.1, engine/generation/teacher.py)
    parsing + thinking encoder (§1.5, §1.6)                       -> emb (student, teacher [, actions]), validity
    selection: H, eligibility, top-K, action filter (§2.2-2.5)   -> pairs_P2
    teacher forcing: diagonal + cross rows in one scoring batch   -> diag_ML, cross_PL

Each phase is timed by the step profiler and returns its metrics. Rectification (§2.7) is the core's
(``alignopsd.estimators.rectify_inputs``), timed here as the ``rectify`` phase, so every alignment cost is booked
as alignment.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.envs.parsing import parse_action, parse_thinking
from alignopsd.engine.envs.registry import get_entry, resolve
from alignopsd.engine.generation.base import SamplingParams, prefill_counts, prefill_delta
from alignopsd.engine.generation.teacher import TeacherOutput, generate_teacher
from alignopsd.engine.parallel.tp_broadcast import broadcast_from_lead
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.rescoring import unpadded_prompts
from alignopsd.kernels import core_uses_kernels, sibling_topk
from torch import Tensor

from alignopsd import action_filter, eligibility, select_sources
from alignopsd.diagnostics import action_filter_metrics
from alignopsd.rectification import pairs_from_selection, similarity_matrix
from alignopsd.reduction import summed, weighted_mean

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

log = logging.getLogger("alignopsd.teacher_pass")


@dataclass
class M1Result:
    """Mechanism 1 inputs of the estimator (rectification itself runs in the core)."""

    H: Tensor | None = None  # [M, M] similarity [source, target]
    eligible: Tensor | None = None  # [M, M] bool
    pairs: Tensor | None = None  # [P, 2] (source, target), grouped by target in rank order
    diag: Tensor | None = None  # [M, L] diagonal teacher log-probs
    cross: Tensor | None = None  # [P, L] cross log-probs in pair order
    student_thinking_valid: Tensor | None = None  # [M] bool
    teacher_thinking_valid: Tensor | None = None  # [M] bool


@dataclass
class Encoded:
    """Embeddings of one encoder call and what is valid (text parsed non-empty and encoder-valid)."""

    student: Tensor  # [M, D] student thinking
    teacher: Tensor  # [M, D] teacher thinking
    student_valid: Tensor  # [M] bool
    teacher_valid: Tensor  # [M] bool
    action_sim: Tensor | None = None  # [M, M] teacher action of source . student action of target
    teacher_action_valid: Tensor | None = None  # [M] bool
    student_action_valid: Tensor | None = None  # [M] bool
    teacher_actions: list[str] | None = None
    student_actions: list[str] | None = None


def teacher_sampling(cfg: RunConfig, seed: int | None = None) -> SamplingParams:
    """The rollout's sampling settings (§2.1: the teacher samples with exactly these; budget and stop are set by
    :func:`~alignopsd.engine.generation.teacher.generate_teacher`), drawn from their own generator seeded with
    ``seed`` (see :func:`teacher_seed`)."""
    g = cfg.generation
    return SamplingParams(
        max_new_tokens=g.max_response_length,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        do_sample=g.do_sample,
        seed=seed,
    )


def teacher_seed(run_seed: int, rank: int, prompt_ids: Tensor) -> int:
    """The teacher's sampling seed: a hash of (run seed, data-parallel rank, the step's teacher prompts), so the
    teacher's draws never depend on the process's global RNG state (which a resumed rank may not share)."""
    h = hashlib.sha256(f"{int(run_seed)}:teacher:{int(rank)}:".encode())
    h.update(prompt_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:4], "little") % (2**31 - 1)


def teacher_generation(
    parts, cb: TurnBatch, *, action_filter: bool, keep_prompt_cache: bool = False
) -> tuple[TeacherOutput, dict[str, float]]:
    """One teacher response per canonical turn from its privileged prompt (§2.1), stopping at the closing tag.
    keep_prompt_cache: keep the prompts' keys and values for the teacher forcing (``out.prompt_cache``)."""
    cfg = parts.cfg
    if cb.teacher_prompt_ids is None or cb.teacher_prompt_mask is None:
        raise ValueError("batch: the rollout produced no teacher prompts (teacher_prompt_ids is None)")
    before = prefill_counts(parts.generator)
    out = generate_teacher(
        parts.generator,
        unpadded_prompts(cb.teacher_prompt_ids, cb.teacher_prompt_mask),
        teacher_sampling(cfg, teacher_seed(cfg.trainer.seed, parts.rank, cb.teacher_prompt_ids)),
        cfg.teacher_budget,
        action_filter,
        teacher_do_sample=cfg.generation.teacher_do_sample,
        max_model_len=cfg.generation.max_model_len,
        keep_prompt_cache=keep_prompt_cache,
    )
    return out, {**out.metrics(), **prefill_delta(before, prefill_counts(parts.generator), "m1/teacher_")}


def encode_texts(parts, cb: TurnBatch, teacher: TeacherOutput, *, action_filter: bool) -> Encoded:
    """One encoder call (§1.6): [student thinking × M, teacher thinking × M (, teacher actions, student actions)]."""
    m = cb.size
    s_think = [parse_thinking(t) for t in cb.response_text]
    texts = [t for t, _ in s_think] + list(teacher.thinking)
    s_act = [parse_action(t) for t in cb.response_text] if action_filter else []
    if action_filter:
        texts += list(teacher.action) + [a for a, _, _ in s_act]
    emb, valid = parts.get_encoder().encode(texts)
    emb, valid = emb.float(), torch.as_tensor(valid, dtype=torch.bool, device=emb.device)
    dev = valid.device
    enc = Encoded(
        student=emb[:m],
        teacher=emb[m : 2 * m],
        student_valid=valid[:m] & torch.tensor([v for _, v in s_think], dtype=torch.bool, device=dev),
        teacher_valid=valid[m : 2 * m] & teacher.thinking_valid.to(dev),
    )
    if action_filter:
        enc.action_sim = (emb[2 * m : 3 * m] @ emb[3 * m :].T).clamp(-1, 1)
        enc.teacher_action_valid = valid[2 * m : 3 * m] & teacher.action_valid.to(dev)
        enc.student_action_valid = valid[3 * m :] & torch.tensor([v for _, v, _ in s_act], dtype=torch.bool, device=dev)
        enc.teacher_actions = list(teacher.action)
        enc.student_actions = [a for a, _, _ in s_act]
    return enc


def select_pairs(parts, cb: TurnBatch, enc: Encoded) -> tuple[Tensor, Tensor, Tensor, dict[str, float]]:
    """(H [M, M], eligible [M, M], pairs [P, 2], metrics): §2.2-2.5 on the encoder's device."""
    cfg = parts.cfg
    rc = cfg.algorithm.rectify
    dev = enc.student.device
    task, roll, turn = cb.task.to(dev), cb.rollout.to(dev), cb.turn.to(dev)
    gamma, top_k = float(rc.gamma), int(rc.top_k)
    if core_uses_kernels(enc.student):
        # CUDA: the fused kernel entry (H, eligibility and top-K in one pass over the embeddings), the one the
        # kernel benchmark and the GPU check measure; H is 0 on cells with an invalid side (never eligible)
        res = sibling_topk(
            enc.teacher,
            enc.student,
            task,
            roll,
            turn,
            enc.teacher_valid,
            enc.student_valid,
            gamma=gamma,
            top_k=top_k,
            impl="triton",
        )
        H, B, selected = res.H, res.eligible, res.selected_lists()
    else:
        H = similarity_matrix(enc.teacher, enc.student, task)
        B = eligibility(task, roll, enc.teacher_valid, enc.student_valid)
        selected = select_sources(H, B, task, roll, turn, gamma=gamma, top_k=top_k)
    metrics: dict[str, float] = {}
    if enc.action_sim is not None:
        before = selected
        selected = action_filter(
            selected,
            enc.action_sim,
            enc.teacher_action_valid,
            enc.student_action_valid,
            threshold=float(rc.action_threshold),
            source_actions=enc.teacher_actions,
            target_actions=enc.student_actions,
            rule=_action_rule(cfg.env.name),
        )
        metrics.update(action_filter_metrics(before, selected, enabled=True, threshold=float(rc.action_threshold)))
        metrics["m1/invalid_student_action_fraction"] = _invalid_fraction(enc.student_action_valid)
        metrics["m1/invalid_teacher_action_fraction"] = _invalid_fraction(enc.teacher_action_valid)
    return H, B, pairs_from_selection(selected), metrics


def _action_rule(env_name: str):
    """The environment's pair rule of the action filter (its registry row's ``action_rule``), or None."""
    path = get_entry(env_name).action_rule
    return resolve(path) if path is not None else None


def _invalid_fraction(valid: Tensor) -> float:
    n = valid.numel()
    return weighted_mean(float((~valid).float().mean()) if n else 0.0, n)


def teacher_diagonal(parts, cb: TurnBatch) -> M1Result:
    """Diagonal teacher forcing only (estimators that need the teacher diagonal but no alignment)."""
    with parts.profiler.phase("teacher_forcing"):
        diag, _, _ = parts.rescorer.teacher_logprobs(cb, None)
    return M1Result(diag=diag)


def mechanism1(parts, cb: TurnBatch) -> tuple[M1Result, dict[str, float]]:
    """Teacher generation, parsing, encoding, selection (+ action filter) and teacher forcing (§2.1-2.6)."""
    prof = parts.profiler
    use_filter = bool(parts.cfg.algorithm.rectify.action_filter)
    log.info("teacher pass: generating %d privileged responses", cb.size)
    keep = parts.rescorer.reads_prompt_cache(parts.generator)  # teacher forcing then pushes only the responses
    with prof.phase("teacher_generation"):
        teacher, metrics = teacher_generation(parts, cb, action_filter=use_filter, keep_prompt_cache=keep)
    parts.release_generation()  # encoding and teacher forcing follow: the engine sleeps until the weight sync
    log.info("teacher pass: %d tokens generated, encoding and matching", teacher.tokens_generated)
    with prof.phase("encoding"):
        enc = encode_texts(parts, cb, teacher, action_filter=use_filter)
    metrics["m1/invalid_student_thinking_fraction"] = _invalid_fraction(enc.student_valid)
    metrics["m1/invalid_teacher_thinking_fraction"] = _invalid_fraction(enc.teacher_valid)
    with prof.phase("m1_selection"):  # once per tensor-parallel group (engine/parallel/tp_broadcast.py)
        H, B, pairs, sel_metrics = broadcast_from_lead(
            parts.policy, lambda: select_pairs(parts, cb, enc), device=enc.student.device
        )
    metrics.update(sel_metrics)
    with prof.phase("teacher_forcing"):  # diagonal + cross rows in one fused scoring batch (§2.6)
        diag, cross, st = parts.rescorer.teacher_logprobs(cb, pairs, prompt_cache=teacher.prompt_cache)
    teacher.prompt_cache = None  # the kept keys and values are freed before the update
    metrics["m1/teacher_forcing_row_count"] = summed(cb.size + pairs.shape[0])
    # 1 when the teacher forcing read the generation's prompt cache: over ranks, the share of the turns that did
    metrics["m1/teacher_forcing_cached_prompts"] = weighted_mean(st.get("cached_prompts", 0), cb.size)
    for k in ("token_forwards", "forwards"):
        if k in st:
            metrics[f"m1/teacher_forcing_{k}"] = summed(st[k])
    return M1Result(H, B, pairs, diag, cross, enc.student_valid, enc.teacher_valid), metrics
