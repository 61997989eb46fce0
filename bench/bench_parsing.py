"""Response parsing cost on adversarial inputs (unclosed tags repeated), per input length.

    python bench/bench_parsing.py                          # the parser in the package, 10k and 100k characters
    python bench/bench_parsing.py --module OLD_parsing.py  # another copy of the module (e.g. an earlier version)
    python bench/bench_parsing.py --append bench/results/parsing-DATE.md

Each case is a degenerate model response of the given length: one tag opened over and over and never
closed, the shape that made a ``.*?`` regular expression quadratic. The time is the minimum over
``--repeat`` calls of ``parse_response`` (all three action tags, thinking required; the two lengths
interleaved), so other load on the machine inflates it as little as possible; the ratio column is
time(100k) / time(10k): about 10 for a linear parser, about 100 for a quadratic one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from types import ModuleType

CASES = {
    "unclosed <think>": lambda n: ("<think>" * n)[:n],
    "unclosed <think head": lambda n: ("<think " * n)[:n],
    "unclosed <action>": lambda n: ("<think>a</think>" + "<action>" * n)[:n],
    "unclosed <ACTION  >": lambda n: ("<think>a</think>" + "<ACTION  >" * n)[:n],
    "unclosed <search>x": lambda n: ("<think>a</think>" + "<search>x" * n)[:n],
    "plain prose": lambda n: (
        ("<think>" + "the agent walks to the cabinet and looks. " * n)[: n - 40]
        + "</think><action>go to cabinet 1</action>"
    ),
}


def load_parser(path: str | None) -> ModuleType:
    if path is None:
        from alignopsd.engine.envs import parsing

        return parsing
    spec = importlib.util.spec_from_file_location("parsing_under_test", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--module: cannot load {path!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def min_times(fn, texts: list[str], repeat: int) -> list[float]:
    """Minimum time of ``fn`` on each text over ``repeat`` rounds, the texts interleaved in every round."""
    best = [float("inf")] * len(texts)
    for _ in range(repeat):
        for k, text in enumerate(texts):
            t0 = time.perf_counter()
            fn(text)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default=None, help="path of a parsing.py to measure instead of the package's")
    ap.add_argument("--sizes", default="10000,100000", help="two comma-separated lengths in characters")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--append", default=None, help="markdown file to append the table rows to")
    args = ap.parse_args()
    small, large = (int(x) for x in args.sizes.split(","))
    parser = load_parser(args.module)
    label = args.module or "package"
    rows = []
    for name, make in CASES.items():
        t_small, t_large = min_times(parser.parse_response, [make(small), make(large)], args.repeat)
        rows.append(
            f"| {label} | {name} | {t_small * 1e3:.3f} | {t_large * 1e3:.3f} | {t_large / t_small:.1f} | "
            f"{os.cpu_count()} CPU, {platform.python_version()} |"
        )
    header = f"| parser | case | ms at {small} | ms at {large} | ratio | machine |\n|---|---|---|---|---|---|"
    print(header)
    print("\n".join(rows))
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
