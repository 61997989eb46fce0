"""The work each phase of a training step must do, and the time a device needs for it at its limits.

One model, used by the profiler's efficiency table (engine/lab/efficiency.py, fed the step's measured counts)
and by ``alignopsd plan`` (engine/commands/plan.py, fed a config's batch). A phase's work is a list of
:class:`Part` s, each compute-bound or decoding:

- **prefill / forward** (compute): matmul FLOPs of the layers over every pushed position, attention FLOPs over
  each position's context, and the output head over the positions whose logits are used;
- **decode** (one token per row per decoding step): the same FLOPs per decoded token, and the bytes each step
  must read: every weight once per step (the rows of a step share them) and each row's keys and values
  (its context). A decoding part takes ``max(FLOPs / rate at M = rows decoded together, bytes / bandwidth)``;
- **update** (compute): forward + backward = 3x the forward FLOPs (4x with gradient checkpointing, which
  recomputes the forward), plus the optimizer's reads and writes (AdamW: fp32 weight, gradient, two moments:
  32 bytes per weight per optimizer step) at the bandwidth.

Phases with no model work (environment, selection, rectification, credit) have no parts; the thinking encoder
is another model and is not modelled. Units: FLOPs, bytes, seconds, per step and per generation group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alignopsd.engine.models.shapes import ModelShape

OPTIMIZER_BYTES_PER_WEIGHT = 32.0  # AdamW step: read fp32 weight, grad, m, v; write weight, m, v (+ a bf16 copy)


@dataclass(frozen=True)
class Part:
    """One kind of work inside a phase."""

    label: str  # "prefill", "decode", "forward", "forward+backward", "optimizer"
    flops: float = 0.0
    bytes: float = 0.0  # bytes that must be read (decode: weights per step + keys/values; optimizer: states)
    rows: float = 0.0  # decode: rows decoded together (the GEMM's M); 0: a large GEMM
    tokens: float = 0.0  # decode: tokens decoded; else positions pushed
    parallel: float = 1.0  # devices the part is split over (tensor parallel)
    steps: float = 0.0  # decode: decoding steps (each as long as its longest row); optimizer: optimizer steps

    @property
    def decode(self) -> bool:
        return self.label == "decode"


@dataclass
class PhaseWork:
    phase: str
    parts: list[Part] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.parts)

    @property
    def bytes(self) -> float:
        return sum(p.bytes for p in self.parts)

    @property
    def decoded_tokens(self) -> float:
        return sum(p.tokens for p in self.parts if p.decode)

    @property
    def decode_bound(self) -> bool:
        """Most of the phase's FLOPs are decoding (its efficiency is then read in bytes/s)."""
        dec = sum(p.flops for p in self.parts if p.decode)
        return dec > 0.5 * self.flops


@dataclass(frozen=True)
class StepCounts:
    """What one step pushes through the model, per generation group (a data-parallel rank)."""

    rows: float  # turn rows the rollout decodes
    rows_per_call: float  # rows decoded together (episodes alive at once)
    prompt_mean: float
    response_mean: float
    rollout_prefill: float  # prompt positions the rollout's prefills push (after prefix sharing)
    train_rows: float  # turn rows scored and trained (canonical turns)
    teacher_rows: float = 0.0  # teacher prompts generated from (0: no teacher pass)
    teacher_prompt_mean: float = 0.0
    teacher_prefill: float = 0.0
    teacher_tokens: float = 0.0  # teacher tokens decoded
    forcing_rows: float = 0.0  # teacher-forced rows (diagonal + cross)
    forcing_positions: float = 0.0  # positions the teacher forcing pushes
    forcing_context: float = 0.0  # mean context a forced position attends (prompt + half its response)
    reference: bool = False  # a reference-policy pass (KL coefficient != 0)
    optimizer_steps: float = 1.0
    recompute: bool = False  # gradient checkpointing
    rollout_steps: float = 0.0  # decoding steps of the rollout (0: rows / rows_per_call x response_mean)
    teacher_steps: float = 0.0  # decoding steps of the teacher generation (0: its mean response, one call)
    scoring_positions: float = 0.0  # positions the old log-prob pass pushes (0: every row's prompt and response)
    padding_fraction: float = 0.0  # share of the plain rows' computed positions that are padding (scoring, update)


def _forward(shape: ModelShape, label: str, positions: float, context: float, logits: float, tp: float) -> Part:
    flops = shape.linear_flops(positions) + shape.attention_flops(positions, context) + shape.head_flops(logits)
    return Part(label, flops=flops, tokens=positions, parallel=tp)


def _decode(
    shape, tokens: float, rows: float, context: float, w_bytes: float, kv_bytes: float, steps: float = 0.0
) -> Part:
    """``tokens`` decoded ``rows`` at a time, each attending ``context`` positions on average; ``steps``: the
    decoding steps taken (0: tokens / rows, every row as long as the mean)."""
    steps = steps or tokens / max(rows, 1.0)
    flops = shape.linear_flops(tokens) + shape.attention_flops(tokens, context) + shape.head_flops(tokens)
    read = steps * shape.weight_bytes(w_bytes) + tokens * context * shape.kv_bytes_per_position(kv_bytes)
    return Part("decode", flops=flops, bytes=read, rows=rows, tokens=tokens, steps=steps)


def step_work(
    shape: ModelShape, c: StepCounts, *, dtype_bytes: float, kv_bytes: float, train_parallel: float = 1.0
) -> dict[str, PhaseWork]:
    """Per-phase work of one step (phases without model work are left out).

    ``dtype_bytes``: bytes of a weight as the model computes; ``kv_bytes``: of a cached key/value element;
    ``train_parallel``: devices a scoring/training forward is split over (tensor parallel); generation runs on
    one device per group."""
    tp = train_parallel
    out = {k: PhaseWork(k) for k in ("rollout_generation", "old_logprob", "update")}
    p, r = c.prompt_mean, c.response_mean
    calls = c.rows / max(c.rows_per_call, 1.0)
    out["rollout_generation"].parts = [
        _forward(shape, "prefill", c.rollout_prefill, p / 2, calls, 1.0),
        _decode(shape, c.rows * r, c.rows_per_call, p + r / 2, dtype_bytes, kv_bytes, c.rollout_steps),
    ]
    if not 0.0 <= c.padding_fraction < 1.0:
        raise ValueError(f"padding_fraction: {c.padding_fraction} is outside [0, 1)")
    seq = c.train_rows * (p + r) / (1.0 - c.padding_fraction)  # positions computed, padded ones included
    ctx = (p + r) / 2
    scored = c.scoring_positions or seq  # the pass pushes shared prompt prefixes once (engine/policy/row_scoring.py)
    out["old_logprob"].parts = [_forward(shape, "forward", scored, ctx, c.train_rows * r, tp)]
    if c.reference:
        out["reference"] = PhaseWork("reference", [_forward(shape, "forward", seq, ctx, c.train_rows * r, tp)])
    fwd = _forward(shape, "forward", seq, ctx, c.train_rows * r, tp)
    times = 4.0 if c.recompute else 3.0
    opt = OPTIMIZER_BYTES_PER_WEIGHT * shape.params / tp * c.optimizer_steps
    out["update"].parts = [
        Part("forward+backward", flops=times * fwd.flops, tokens=seq, parallel=tp),
        Part("optimizer", bytes=opt, parallel=1.0, steps=c.optimizer_steps),
    ]
    if c.teacher_rows > 0:
        tr = c.teacher_tokens / c.teacher_rows
        out["teacher_generation"] = PhaseWork(
            "teacher_generation",
            [
                _forward(shape, "prefill", c.teacher_prefill, c.teacher_prompt_mean / 2, c.teacher_rows, 1.0),
                _decode(
                    shape,
                    c.teacher_tokens,
                    c.teacher_rows,
                    c.teacher_prompt_mean + tr / 2,
                    dtype_bytes,
                    kv_bytes,
                    c.teacher_steps or tr,
                ),
            ],
        )
    if c.forcing_rows > 0:
        out["teacher_forcing"] = PhaseWork(
            "teacher_forcing",
            [_forward(shape, "forward", c.forcing_positions, c.forcing_context, c.forcing_rows * r, tp)],
        )
    return out
