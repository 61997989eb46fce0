"""Count what the quickstart pipeline builds: config file reads and parses, causal-LM loads, Trainer constructions.

``python -m bench.pipeline_builds [-- sft-arguments...]`` runs ``alignopsd sft`` in this process (by default the
``make run`` pipeline at a few seconds' size: the quickstart config on the tiny model, 2 warm-start steps, 1 RL step,
4 training and 2 held-out games) with the real functions wrapped by counters, and prints one JSON line of counts.
Nothing is reimplemented: each counter calls the function it wraps. The counts are the pipeline's structure, the
same at any model size (``make run``'s arguments give the same counts, in half an hour).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import tempfile
from collections import Counter

DEFAULT_ARGS = [
    "sft", "--pipeline", "--easy-games", "--config", "configs/quickstart_cpu.yaml", "--steps", "2",
    "--set", "model.name=tiny", "--set", "trainer.total_steps=1", "--set", "env.num_games=4",
    "--set", "env.val_tasks=2", "--set", "trainer.logging.report=false",
]  # fmt: skip

# (module, attribute, counter name): what is counted
COUNTED = (
    ("alignopsd.engine.config.loader", "read_yaml", "config file reads"),
    ("alignopsd.engine.config.schema", "load_config", "config parses (load_config)"),
    ("alignopsd.engine.models.loading", "load_causal_lm", "causal LM loads"),
)


def _wrap(fn, name: str, counts: Counter):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return counted


@contextlib.contextmanager
def counting(counts: Counter):
    """Within the block, each :data:`COUNTED` function (in its module and in every loaded module that imported it
    by name) and ``Trainer.__init__`` count their calls into ``counts``; restored after."""
    import importlib

    import alignopsd.engine.commands.cli  # noqa: F401 - loads the command modules that import the counted names
    import alignopsd.engine.commands.sft  # noqa: F401
    from alignopsd.engine.run.trainer import Trainer

    undo = [(Trainer, "__init__", Trainer.__init__)]
    for mod_name, attr, name in COUNTED:
        orig = getattr(importlib.import_module(mod_name), attr)
        wrapped = _wrap(orig, name, counts)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("alignopsd") and getattr(mod, attr, None) is orig:
                undo.append((mod, attr, orig))
                setattr(mod, attr, wrapped)
    Trainer.__init__ = _wrap(Trainer.__init__, "Trainer constructions", counts)
    try:
        yield counts
    finally:
        for obj, attr, orig in reversed(undo):
            setattr(obj, attr, orig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = argv or DEFAULT_ARGS
    from alignopsd.engine.commands.cli import main as cli_main

    with tempfile.TemporaryDirectory() as tmp, counting(Counter()) as counts:
        if not argv:
            args = [*args, "--set", f"output_dir={tmp}/run"]
        rc = cli_main(args)
    print(json.dumps({"rc": rc, "args": args, "counts": dict(counts)}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
