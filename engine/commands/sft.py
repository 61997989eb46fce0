"""Supervised warm start on expert walkthroughs, and the quickstart pipeline built on it.

``alignopsd sft --config FILE --out DIR [--steps N] [--set k=v ...]`` fine-tunes the config's model on the expert
turns of its ALFWorld training games and writes a Hugging Face checkpoint (safetensors, config, tokenizer) that a
run then starts from with ``model.name: DIR``. ``--pipeline`` runs the whole quickstart instead: held-out
evaluation of the base model, the warm start, its evaluation, the RL run starting from it, and the RL model's
evaluation, all on the same held-out games; the three held-out rows are printed and written into ``report.md``.
``--easy-games`` plays generated pick-and-place games in small rooms whose expert walkthrough fits the turn limit.
The pipeline's first lines give the CPU profile (torch's kernel capability, the native-bf16 verdict, the dtype) and
an estimate of each stage's time from a few seconds of calibration on the run's own code paths
(engine/commands/estimate.py); ``--estimate`` prints them and exits.

The data (one example per expert turn): the prompt is what the rollout would give the policy at that turn (the
episode is played through the engine's :class:`EnvManager` with the expert's actions, and its user text goes
through the same chat template, tokenisation and left truncation as in ``rollout``); the response is
``<think>T</think><action>A</action>`` and the end-of-turn token, where A is the walkthrough's action and T a
short reasoning written from the game's own facts (task, target object and receptacle, what is held, the next
sub-goal). The loss is the next-token cross entropy on the response tokens only, averaged over them.

Legend: B = examples in a micro-batch, T = padded length (prompt + response).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from alignopsd.engine.envs.alfworld.expert import SEARCH_DETOURS, ExpertTurn, expert_turns
from alignopsd.engine.envs.prompts import chat_text
from alignopsd.engine.observe.progress import time_left
from alignopsd.engine.tokens.layout import truncate_left

SFT_MARKER = "alignopsd_sft.json"


def encode_turn(tokenizer, turn: ExpertTurn, max_prompt_length: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one example; the prompt exactly as the rollout tokenises it."""
    ids = tokenizer(chat_text(tokenizer, turn.user_text), add_special_tokens=False)["input_ids"]
    ids, _ = truncate_left(ids, max_prompt_length)
    resp = tokenizer(turn.response, add_special_tokens=False)["input_ids"] + [int(tokenizer.eos_token_id)]
    return ids, resp


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (input_ids_BT, attention_BT, labels_BT); labels -100 outside the responses."""
    width = max(len(p) + len(r) for p, r in examples)
    ids_BT = torch.full((len(examples), width), pad_id, dtype=torch.long)
    att_BT = torch.zeros((len(examples), width), dtype=torch.long)
    lab_BT = torch.full((len(examples), width), -100, dtype=torch.long)
    for b, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        ids_BT[b, :n] = torch.tensor(p + r)
        att_BT[b, :n] = 1
        lab_BT[b, len(p) : n] = torch.tensor(r)
    return ids_BT, att_BT, lab_BT


def response_loss(model, examples: list[tuple[list[int], list[int]]], pad_id: int, compute_dtype=None):
    """Mean next-token cross entropy over the response tokens of ``examples``."""
    ids_BT, att_BT, lab_BT = _batch(examples, pad_id)
    dev = next(model.parameters()).device
    ids_BT, att_BT, lab_BT = ids_BT.to(dev), att_BT.to(dev), lab_BT.to(dev)
    tgt_BT = lab_BT[:, 1:]
    keep_BT = tgt_BT != -100
    with torch.autocast(dev.type, dtype=compute_dtype, enabled=compute_dtype is not None):
        hidden_BTH = model.base_model(input_ids=ids_BT, attention_mask=att_BT).last_hidden_state
        # the LM head only where a response token is predicted (a tenth of the positions)
        logits_NV = model.get_output_embeddings()(hidden_BTH[:, :-1][keep_BT])
    return torch.nn.functional.cross_entropy(logits_NV.float(), tgt_BT[keep_BT])


def sft_train(
    model,
    examples: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    steps: int,
    lr: float = 1e-4,
    batch_size: int = 4,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    log_every: int = 10,
    stream=None,
) -> list[float]:
    """``steps`` AdamW steps on shuffled mini-batches of ``examples`` (epochs as needed); returns the losses.

    Linear warm-up over the first 10% of the steps, then constant; gradients clipped to norm 1. A progress line
    every ``log_every`` steps (loss, tokens per second, elapsed time) goes to ``stream``.
    """
    if not examples:
        raise ValueError("examples: expected at least one expert turn")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps/batch_size: expected >= 1, got {steps}/{batch_size}")
    stream = stream if stream is not None else sys.stdout
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    order: list[int] = []
    losses: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            more = list(range(len(examples)))
            rng.shuffle(more)
            order += more
        batch = [examples[i] for i in order[:batch_size]]
        del order[:batch_size]
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / warm)
        loss = response_loss(model, batch, pad_id, compute_dtype)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += sum(len(p) + len(r) for p, r in batch)
        if step % log_every == 0 or step == steps:
            dt = time.perf_counter() - t0
            print(
                f"[sft] step {step:4d}/{steps} | loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f} | "
                f"{tokens / dt:.0f} tok/s | {dt:.0f}s" + (f" | {left}" if (left := time_left(dt, step, steps)) else ""),
                file=stream,
                flush=True,
            )
    model.eval()
    return losses


def warm_start_rates(cfg, *, prompt: int = 320, response: int = 40) -> tuple[float, float]:
    """(FLOP/s of the warm start's forward + backward, seconds of its optimizer step): two steps of
    :func:`response_loss` and AdamW on one example of random ids, with the model, device and compute dtype
    :func:`run_sft` uses (the faster of the two counts; the first pays for allocation)."""
    from alignopsd.engine.cost.model_shapes import resolve_shape
    from alignopsd.engine.models.loading import load_causal_lm, parse_dtype
    from alignopsd.engine.run.calibration import best_of, forward_flops, random_ids
    from alignopsd.engine.run.process import pick_device

    shape = resolve_shape(cfg.model.name)
    model = load_causal_lm(cfg.model.name, dtype="float32", attn_implementation=cfg.model.attn_implementation)
    model.to(pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0"))))
    compute = parse_dtype(cfg.model.dtype)
    ids = random_ids(1, prompt + response, shape.vocab, seed=4)[0].tolist()
    example = [(ids[:prompt], ids[prompt:])]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-9)
    model.train()

    def micro() -> None:
        response_loss(model, example, 0, None if compute == torch.float32 else compute).backward()

    t_fb = best_of(micro)
    t_opt = best_of(opt.step)
    n = prompt + response
    return 3.0 * forward_flops(shape, n, n / 2, response) / t_fb, t_opt


def save_warm_start(model, tokenizer, out_dir: str | Path, *, base: str, meta: dict) -> Path:
    """Write the fine-tuned model as a Hugging Face folder (fp32 safetensors + tokenizer + a marker) through the
    engine's one weight writer (engine/checkpoint/weights.py): built beside ``out_dir``, listed in its manifest, then
    renamed into place (an earlier folder there is replaced whole)."""
    from alignopsd.engine.checkpoint.weights import publish_folder, save_model_files
    from alignopsd.engine.infra.writes import writing

    model.to(torch.float32)

    def fill(tmp: Path) -> None:
        save_model_files(tmp, model)
        with writing(tmp / "tokenizer.json"):  # and the tokenizer's other files
            tokenizer.save_pretrained(tmp)
        with writing(tmp / SFT_MARKER):
            (tmp / SFT_MARKER).write_text(json.dumps({"base": base, **meta}, indent=1))

    return publish_folder(Path(out_dir), fill)


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_warm_start(path: str | Path, base: str) -> Path:
    """A warm-start checkpoint usable for model ``base``; ValueError naming the problem otherwise.

    Cheap (reads two JSON files): call it before anything heavy loads.
    """
    from alignopsd.engine.models.loading import resolve_model_path

    p = Path(path).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(
            f"warm start: {str(p)!r} is not a checkpoint folder (config.json + *.safetensors); "
            "write one with `alignopsd sft --config FILE --out DIR`"
        )
    marker = p / SFT_MARKER
    if marker.is_file():
        made_from = json.loads(marker.read_text()).get("base")
        if made_from != base:
            raise ValueError(f"warm start: {str(p)!r} was fine-tuned from {made_from!r}, not from model {base!r}")
    mine = json.loads((p / "config.json").read_text())
    theirs = json.loads((Path(resolve_model_path(base)) / "config.json").read_text())
    diff = [k for k in _SHAPE_KEYS if mine.get(k) != theirs.get(k)]
    if diff:
        raise ValueError(
            f"warm start: {str(p)!r} belongs to another model than {base!r} "
            f"({', '.join(f'{k} {mine.get(k)} vs {theirs.get(k)}' for k in diff)})"
        )
    return p


def build_examples(cfg, tokenizer, *, n_games: int | None = None) -> tuple[list[ExpertTurn], list]:
    """(expert turns, encoded examples) of the config's training games (ALFWorld only).

    Each game is played with :data:`SEARCH_DETOURS` searched receptacles before the walkthrough; its step limit
    is raised by the turns they may take, so every game gets them (the prompts are the rollout's otherwise)."""
    from alignopsd.engine.run.components import build_env

    if cfg.env.name != "alfworld":
        raise ValueError(f"env.name: the warm start needs expert walkthroughs (alfworld), got {cfg.env.name!r}")
    limit = cfg.env.max_turns + 2 * SEARCH_DETOURS
    derived = cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_turns": limit})})
    manager, train_tasks, _ = build_env(derived.validate())  # a copy is not validated: check it as loading would
    try:
        seen, tasks = set(), []
        for t in train_tasks:  # the task pool may repeat games; one walkthrough each
            if t.key not in seen:
                seen.add(t.key)
                tasks.append(t)
        turns = expert_turns(
            manager,
            tasks[:n_games] if n_games else tasks,
            seed=cfg.trainer.seed,
            detours=SEARCH_DETOURS,
            max_turns=limit,
        )
    finally:
        manager.close()
    return turns, [encode_turn(tokenizer, t, cfg.env.max_prompt_length) for t in turns]


def run_sft(cfg, out_dir: str | Path, *, steps: int, lr: float, batch_size: int, stream=None) -> Path:
    """The warm start: expert examples of ``cfg``'s training games -> fine-tuned checkpoint in ``out_dir``."""
    from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer, parse_dtype

    stream = stream if stream is not None else sys.stdout
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    turns, examples = build_examples(cfg, tokenizer)
    n_tok = sum(len(p) + len(r) for p, r in examples)
    print(f"[sft] {len(turns)} expert turns, {n_tok} tokens ({time.perf_counter() - t0:.0f}s)", file=stream, flush=True)
    from alignopsd.engine.run.process import pick_device

    model = load_causal_lm(cfg.model.name, dtype="float32", attn_implementation=cfg.model.attn_implementation)
    model.to(pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0"))))  # trainer.device, as the RL run's
    compute = parse_dtype(cfg.model.dtype)
    torch.manual_seed(cfg.trainer.seed)
    losses = sft_train(
        model,
        examples,
        pad_id=int(tokenizer.pad_token_id or tokenizer.eos_token_id),
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=cfg.trainer.seed,
        compute_dtype=None if compute == torch.float32 else compute,
        stream=stream,
    )
    meta = {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "examples": len(examples),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": time.perf_counter() - t0,
    }
    return save_warm_start(model, tokenizer, out_dir, base=cfg.model.name, meta=meta)


EASY_MAX_WALKTHROUGH = 8  # turn limit of the quickstart; the easy games' expert wins within it


def _easy_splits(cfg) -> tuple[tuple[str, int, int], ...]:
    return (cfg.env.split, cfg.env.num_games, 11), (cfg.env.val_split, cfg.env.val_tasks, 12)


def easy_games_root(cfg, *, generate: bool = True) -> tuple[Path, int]:
    """(folder, games not generated yet) of the easy games (official layout): pick-and-place in small rooms, expert
    walkthrough of at most ``EASY_MAX_WALKTHROUGH`` steps; ``env.num_games`` training and ``env.val_tasks`` held-out
    games, generated once (unless ``generate`` is false) and cached beside the generated splits."""
    from alignopsd.engine.envs.alfworld.env import default_cache_dir
    from alignopsd.engine.envs.alfworld.gen import generate_games

    if cfg.env.name != "alfworld":
        raise ValueError(f"--easy-games: only for env.name alfworld, got {cfg.env.name!r}")
    if cfg.env.max_turns < EASY_MAX_WALKTHROUGH:
        raise ValueError(f"--easy-games: env.max_turns must be >= {EASY_MAX_WALKTHROUGH}, got {cfg.env.max_turns}")
    missing = 0
    root = default_cache_dir() / f"easy-pick-w{EASY_MAX_WALKTHROUGH}-n{cfg.env.num_games}-v{cfg.env.val_tasks}"
    for split, n, seed in _easy_splits(cfg):
        done = root / f"COMPLETE-{split}"
        if done.exists() or not generate:
            missing += 0 if done.exists() else n
            continue
        print(f"[games] generating {n} easy {split} games under {root}", flush=True)
        generate_games(
            n,
            root,
            seed=seed,
            split=split,
            task_types=("pick_and_place_simple",),
            max_steps=EASY_MAX_WALKTHROUGH,
            max_tries_per_game=40,
            small=True,
        )
        done.write_text(str(n))
    return root, missing


def _heldout(cfg, checkpoint: str | None, label: str, times: dict, stream) -> dict:
    from alignopsd.engine.commands.evaluate import evaluate

    t0 = time.perf_counter()
    print(f"[quickstart] held-out evaluation: {label} ({cfg.env.val_tasks} games)", file=stream, flush=True)
    res = evaluate(cfg, checkpoint)
    times[f"eval {label}"] = time.perf_counter() - t0
    m = res["metrics"]
    row = {
        "success": m.get("episode/success_rate"),
        "valid": m.get("episode/valid_action_rate"),
        "turns": m.get("episode/turns_mean"),
        "episodes": res["episodes"],
    }
    print(f"[quickstart] {label}: {row}", file=stream, flush=True)
    return row


def run_pipeline(config: str, overrides: list[str], args, sft_out: Path, *, times=None, stream=None) -> dict:
    """The quickstart: base eval -> warm start -> eval -> RL from the warm start -> eval; report.md gets the
    three held-out rows and the stage times (added to ``times``). Returns {"heldout": {stage: row}, "times":
    {stage: seconds}}. ``args``: ``steps``, ``lr``, ``batch_size``, ``warm_start`` (see :func:`add_sft_args`)."""
    from alignopsd.engine.checkpoint.checkpoint import step_dir_name
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.observe.report import heldout_table, write_report
    from alignopsd.engine.run.trainer import Trainer

    stream = stream if stream is not None else sys.stdout
    cfg = load_config(config, overrides)
    times = {} if times is None else times
    rows: dict[str, dict] = {}
    rows[f"base ({cfg.model.name})"] = _heldout(cfg, None, "base", times, stream)
    if args.warm_start:
        sft_out = Path(args.warm_start)
    else:
        t0 = time.perf_counter()
        run_sft(cfg, sft_out, steps=args.steps, lr=args.lr, batch_size=args.batch_size, stream=stream)
        times["warm start"] = time.perf_counter() - t0
    rl_over = overrides + [f"model.name={sft_out}", "trainer.val_after_train=false"]
    rl_cfg = load_config(config, rl_over)
    rows["after warm start"] = _heldout(rl_cfg, None, "warm start", times, stream)
    t0 = time.perf_counter()
    trainer = Trainer(rl_cfg, stream=stream)
    try:
        trainer.fit()
    finally:
        trainer.dist.close()
    times["RL steps"] = time.perf_counter() - t0
    ckpt = rl_cfg.out_dir / "checkpoints" / step_dir_name(rl_cfg.trainer.total_steps)
    rows[f"after {rl_cfg.trainer.total_steps} RL steps"] = _heldout(rl_cfg, str(ckpt), "RL", times, stream)
    table = heldout_table(rows, times)
    print(table, file=stream, flush=True)
    if rl_cfg.trainer.report:
        write_report(rl_cfg.out_dir, title=f"{rl_cfg.name}: {rl_cfg.algorithm_name()}", extra=table)
    return {"heldout": rows, "times": times}


def pipeline_estimate(cfg, args) -> str:
    """The CPU profile line and the pipeline's estimated stage times from a short calibration in this process
    (engine/commands/estimate.py)."""
    from alignopsd.engine.commands.estimate import cpu_profile_line, estimate_pipeline, format_estimate
    from alignopsd.engine.cost.model_shapes import resolve_shape
    from alignopsd.engine.run.calibration import calibrate_phases
    from alignopsd.engine.run.process import pick_device

    device = pick_device(cfg)
    games = easy_games_root(cfg, generate=False)[1] if args.easy_games else 0
    rates = calibrate_phases(cfg, device)
    t0 = time.perf_counter()
    rates.warm_flops, rates.warm_step_s = warm_start_rates(cfg)
    rates.seconds += time.perf_counter() - t0
    stages = estimate_pipeline(
        cfg, resolve_shape(cfg.model.name), rates, steps=args.steps, batch=args.batch_size, games=games
    )
    if args.warm_start:  # given: not trained here
        stages = [s for s in stages if s.name != "warm start"]
    return "\n".join([cpu_profile_line(cfg.model.dtype, device.type), format_estimate(stages, rates)])


def add_sft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="checkpoint folder (default: <run output>/sft)")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps (batches of --batch-size expert turns)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--pipeline", action="store_true", help="base eval, warm start, eval, RL, eval (the quickstart)")
    p.add_argument("--warm-start", default=None, help="with --pipeline: use this checkpoint instead of training one")
    p.add_argument("--easy-games", action="store_true", help="pick-and-place games in small rooms (see doc)")
    p.add_argument(
        "--estimate", action="store_true", help="print the CPU profile and the pipeline's estimated time, then exit"
    )


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.commands.options import add_run_args
    from alignopsd.engine.config.schema import ConfigError, load_config
    from alignopsd.engine.infra.writes import WriteFailure
    from alignopsd.engine.infra.writes import report as report_write_failure

    p = argparse.ArgumentParser(prog="alignopsd sft", description="Supervised warm start on expert walkthroughs.")
    add_run_args(p)
    add_sft_args(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        p.error("--steps and --batch-size must be >= 1 and --lr > 0")
    overrides = list(args.overrides or [])
    try:
        cfg = load_config(args.config, overrides)
        if args.warm_start:
            check_warm_start(args.warm_start, cfg.model.name)
        if args.pipeline:  # its RL stage logs to trainer.loggers: a tracker that cannot start fails here
            from alignopsd.engine.config.logger_check import check_loggers

            check_loggers(cfg.trainer, cfg.out_dir, os.environ)
    except (ConfigError, ValueError) as exc:
        print(f"alignopsd sft: {exc}", file=sys.stderr)
        return 2
    print(cfg.dtype_line(), flush=True)
    if args.pipeline or args.estimate:  # the first lines say what the run will cost
        print(pipeline_estimate(cfg, args), flush=True)
        if args.estimate:
            return 0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as `alignopsd train`
    times: dict[str, float] = {}
    if args.easy_games:
        t0 = time.perf_counter()
        overrides.append(f"env.data_dir={easy_games_root(cfg)[0]}")
        times["games"] = time.perf_counter() - t0
        cfg = load_config(args.config, overrides)
    out = Path(args.out) if args.out else cfg.out_dir / "sft"
    try:
        if not args.pipeline:
            run_sft(cfg, out, steps=args.steps, lr=args.lr, batch_size=args.batch_size)
            print(f"[sft] checkpoint: {out}")
            return 0
        run_pipeline(args.config, overrides, args, out, times=times)
    except WriteFailure as exc:  # a full disk, a file size limit or an I/O error (engine/infra/writes.py)
        return report_write_failure(exc, "alignopsd sft")
    return 0


if __name__ == "__main__":
    sys.exit(main())
