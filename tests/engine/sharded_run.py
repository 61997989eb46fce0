"""The trainer's command line under ``torchrun``, for the sharded-checkpoint tests (test_sharded_checkpoints.py).

``torchrun --nproc_per_node=N tests/engine/sharded_run.py [--stop-after K] [--dump-save F] [--dump-load F] ARGS``
registers the guess environment and the candidate-choice generator (learn_helpers: a random tiny model cannot
write the tag format, so the steps would carry no learning signal), then runs
``alignopsd.engine.commands.train.main(ARGS)``:
the real command line (pre-flight, resume checks, Trainer, saves and loads).

``--stop-after K``: every rank exits at once (``os._exit``, no clean-up, like a kill) right after step K's
checkpoint is written. ``--kill-at K:R:FILE``: rank R SIGKILLs itself in step K unless FILE exists (it creates it
first: one fault per run, the restarted attempt passes). ``--kill-node-at K:FILE``: in step K, the worker whose
environment has ``ALIGNOPSD_TEST_KILL_NODE=1`` (the test sets it for one node's agent) SIGKILLs its torchrun agent
and then itself unless FILE exists (created first): a node lost, agent and all. ``--fail-at K``: every rank raises
the same ValueError in step K, in every attempt (a deterministic failure). ``--chaos FILE``: the faults of a JSON
schedule, each ``{"id", "step", "rank", "kind", "at"}`` fired once (a marker file ``FILE.<id>`` is created first):
``kill`` SIGKILLs the rank on entering phase ``at`` of the step (a profiler phase name, or ``save``: rank 0 in the
middle of writing the checkpoint, its weights written, its trainer state not), ``term_agent`` sends SIGTERM to the
torchrun agent (a preemption of the whole job) on entering the phase, ``disk_full`` makes rank 0's checkpoint write
fail with ENOSPC.
``--dump-save F`` / ``--dump-load F``: rank 0 writes the policy's gathered weights and optimizer state
(engine/checkpoint/statefile.py) right after the last save / right after a resume loaded the checkpoint."""

from __future__ import annotations

import argparse
import os
import signal
import sys


def dump(policy, path: str) -> None:
    """Gathered weights and optimizer state of every tensor-parallel rank (collective; rank 0 writes ``path``)."""
    from alignopsd.engine.checkpoint.statefile import save_state

    state = {"weights": policy.hf_state_dict(), "optimizer": policy.optimizer_state()}
    if int(os.environ.get("RANK", "0")) == 0:
        save_state(path, state)


NOW = {"step": 0, "rank": 0}  # the step being run (1-based) and this process's data-parallel rank


def install_chaos(schedule: str) -> None:
    """Fault hooks of the schedule in ``schedule`` around the profiler's phases and the checkpoint's writer."""
    import contextlib
    import errno
    import json

    from alignopsd.engine.checkpoint import checkpoint as ck
    from alignopsd.engine.infra.writes import writing
    from alignopsd.engine.observe import profiler

    faults = json.loads(open(schedule).read())

    def due(at: str) -> dict | None:
        for f in faults:
            marker = f"{schedule}.{f['id']}"
            if f["step"] == NOW["step"] and f["rank"] == NOW["rank"] and f["at"] == at and not os.path.exists(marker):
                open(marker, "w").close()
                return f
        return None

    def act(f: dict | None) -> None:
        if f is None:
            return
        sys.stdout.flush()
        if f["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["kind"] == "term_agent":
            os.kill(os.getppid(), signal.SIGTERM)

    phase = profiler.StepProfiler.phase

    @contextlib.contextmanager
    def chaos_phase(self, name):
        act(due(name))
        with phase(self, name):
            yield

    profiler.StepProfiler.phase = chaos_phase
    write_state = ck.write_trainer_state

    def chaos_write_state(folder, state):
        f = due("save")
        if f is not None and f["kind"] == "disk_full":
            with writing(os.path.join(folder, "trainer_state.json")):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        act(f)
        return write_state(folder, state)

    ck.write_trainer_state = chaos_write_state


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--dump-save", default=None)
    p.add_argument("--dump-load", default=None)
    p.add_argument("--kill-at", default=None)
    p.add_argument("--kill-node-at", default=None)
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--chaos", default=None)
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
    run_step = train.run_step

    def faulty_step(parts, step):
        NOW.update(step=step + 1, rank=parts.rank)
        if args.kill_at:
            k, r, marker = args.kill_at.split(":", 2)
            if step + 1 == int(k) and parts.rank == int(r) and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        if args.kill_node_at and os.environ.get("ALIGNOPSD_TEST_KILL_NODE") == "1":
            k, marker = args.kill_node_at.split(":", 1)
            if step + 1 == int(k) and not os.path.exists(marker):
                open(marker, "w").close()
                sys.stdout.flush()
                os.kill(os.getppid(), signal.SIGKILL)  # the node's agent
                os.kill(os.getpid(), signal.SIGKILL)
        if args.fail_at is not None and step + 1 == args.fail_at:
            raise ValueError(f"an injected deterministic failure in step {step + 1}")
        return run_step(parts, step)

    train.run_step = faulty_step
    if args.chaos:
        install_chaos(args.chaos)
    from alignopsd.engine.commands.train import main as train_main

    return train_main(train_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
