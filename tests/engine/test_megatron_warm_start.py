"""The warm start under the Megatron backend with tensor parallelism (run as ``torchrun --nproc_per_node=2 -m pytest
-m distributed``): ``alignopsd sft`` end to end on the tiny model at TP=2 trains what the Hugging Face backend trains
on the same expert examples, and writes a folder the RL run loads.

Tolerances (fp32), as in test_megatron_steps.py: tensor parallelism sums partial products in another order, so the
losses agree to 1e-4 relative; Adam's first steps move each weight by about lr, so weights are compared at 0.1 * lr.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]

ROOT = Path(__file__).resolve().parents[2]
LR, STEPS, BATCH = 1e-4, 3, 4


def _shared_dir() -> Path:
    """A folder both ranks see (rank 0 fills it, then both pass a barrier)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    root = Path(tempfile.gettempdir()) / f"alignopsd-mega-sft-{os.environ.get('MASTER_PORT', '0')}"
    if int(os.environ["RANK"]) == 0:
        from alignopsd.engine.envs.alfworld.gen import generate_games

        shutil.rmtree(root, ignore_errors=True)
        generate_games(3, root / "games", seed=5, task_types=("pick_and_place_simple",), max_steps=8, small=True)
    dist.barrier()
    return root


def _overrides(games: Path, out: Path) -> list[str]:
    return [
        "env.name=alfworld",
        f"env.data_dir={games}",
        "env.split=train",
        "env.val_split=train",
        "env.num_games=3",
        "env.val_tasks=2",
        "env.max_turns=8",
        f"output_dir={out}",
    ]


def _hf_reference(cfg, tokenizer) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same warm start on one process with the Hugging Face backend: (losses, weights)."""
    from alignopsd.engine.models.loading import load_causal_lm
    from alignopsd.engine.policy.hf import HFPolicy
    from alignopsd.engine.run.components import build_games
    from alignopsd.engine.run.warm_start import build_examples, train_supervised, warm_start_optimizer
    from alignopsd.engine.tokens.special import token_ids

    games = build_games(cfg)
    try:
        _, examples = build_examples(cfg, tokenizer, games)
    finally:
        games.close()
    opt = warm_start_optimizer(LR, STEPS)
    policy = HFPolicy(
        load_causal_lm("tiny", dtype="float32"),
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        warmup_steps=opt.warmup_steps,
        ddp=False,
    )
    losses = train_supervised(
        policy,
        examples,
        pad_id=token_ids(tokenizer).pad,
        steps=STEPS,
        batch_size=BATCH,
        seed=cfg.trainer.seed,
        stream=open(os.devnull, "w"),
    )
    return losses, policy.hf_state_dict()


def test_tp2_warm_start_end_to_end_equals_hf_backend(capsys):
    import torch.distributed as dist
    from alignopsd.engine.commands.cli import main
    from alignopsd.engine.commands.sft import SFT_MARKER, check_warm_start
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    root = _shared_dir()
    out = root / "sft"
    sets = [x for o in _overrides(root / "games", root / "run") for x in ("--set", o)]
    argv = [
        "sft",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        *sets,
        "--set",
        "policy.backend=megatron",
        "--set",
        "policy.tensor_parallel_size=2",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--lr",
        str(LR),
    ]
    assert main(argv) == 0
    dist.barrier()
    assert check_warm_start(out, "tiny") == out  # every rank sees the one folder rank 0 wrote
    meta = json.loads((out / SFT_MARKER).read_text())
    assert meta["steps"] == STEPS and meta["examples"] > BATCH
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), _overrides(root / "games", root / "run"))
    losses, ref = _hf_reference(cfg, load_tokenizer("tiny"))
    assert meta["loss_first"] == pytest.approx(losses[0], rel=1e-4)
    assert meta["loss_last"] == pytest.approx(losses[-1], rel=1e-4)
    ours = load_causal_lm(str(out), dtype="float32").state_dict()  # the folder loads as the RL run loads it
    start = load_causal_lm("tiny", dtype="float32").state_dict()
    moved = 0.0
    for k, v in ref.items():
        assert (ours[k] - v).abs().max().item() <= 0.1 * LR, k
        moved = max(moved, (v - start[k]).abs().max().item())
    assert moved > 0.5 * LR  # the warm start really moved the weights
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        shutil.rmtree(root, ignore_errors=True)
