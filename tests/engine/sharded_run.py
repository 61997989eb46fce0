"""The trainer's command line under ``torchrun``, for the sharded-checkpoint tests (test_sharded_checkpoints.py).

``torchrun --nproc_per_node=N tests/engine/sharded_run.py [--stop-after K] [--dump-save F] [--dump-load F] ARGS``
registers the guess environment and the candidate-choice generator (learn_helpers: a random tiny model cannot
write the tag format, so the steps would carry no learning signal), then runs
``alignopsd.engine.commands.train.main(ARGS)``:
the real command line (pre-flight, resume checks, Trainer, saves and loads).

``--stop-after K``: every rank exits at once (``os._exit``, no clean-up, like a kill) right after step K's
checkpoint is written. ``--dump-save F`` / ``--dump-load F``: rank 0 writes the policy's gathered weights and
optimizer state (engine/checkpoint/statefile.py) right after the last save / right after a resume loaded the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys


def dump(policy, path: str) -> None:
    """Gathered weights and optimizer state of every tensor-parallel rank (collective; rank 0 writes ``path``)."""
    from alignopsd.engine.checkpoint.statefile import save_state

    state = {"weights": policy.hf_state_dict(), "optimizer": policy.optimizer_state()}
    if int(os.environ.get("RANK", "0")) == 0:
        save_state(path, state)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--dump-save", default=None)
    p.add_argument("--dump-load", default=None)
    args, train_args = p.parse_known_args(argv)  # the rest is the train command line

    import learn_helpers as lh
    import torch
    from alignopsd.engine.generation.choice import ChoiceGenerator
    from alignopsd.engine.run import components
    from alignopsd.engine.run import trainer as train

    torch.set_num_threads(1)
    lh.register_guess_env()
    build_generator = components.build_generator

    def choice_generator(cfg, policy, tok, device):
        """The run's own generator's model (on the first rank of a tensor-parallel group; None elsewhere)."""
        gen = build_generator(cfg, policy, tok, device)
        return None if gen is None else ChoiceGenerator(gen.model, tok)

    components.build_generator = choice_generator
    save, load = train.Trainer.save, train.Trainer.load

    def save_then(self):
        out = save(self)
        if args.stop_after is not None and self.step == args.stop_after:
            sys.stdout.flush()
            os._exit(9)
        if args.dump_save and self.step == self.cfg.trainer.total_steps:
            dump(self.parts.policy, args.dump_save)
        return out

    def load_then(self, path):
        load(self, path)
        if args.dump_load:
            dump(self.parts.policy, args.dump_load)

    train.Trainer.save, train.Trainer.load = save_then, load_then
    from alignopsd.engine.commands.train import main as train_main

    return train_main(train_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
