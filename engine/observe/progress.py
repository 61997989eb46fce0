"""Time-left estimates for the progress lines of long stages (RL steps, SFT steps, rollout turns).

``time_left(elapsed_s, done, total)`` extrapolates the mean time per finished unit over the units still to run
and formats it as ``~4m10s left``; ``""`` when nothing is finished yet or nothing is left. Rollout turns use it
as an upper bound (episodes that end early make later turns cheaper), and say so.
"""

from __future__ import annotations

import math


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m`` for a non-negative duration."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def time_left(elapsed_s: float, done: int, total: int, *, bound: bool = False) -> str:
    """``~Xs left`` from ``done`` of ``total`` units finished in ``elapsed_s`` seconds (``<= Xs left`` when the
    estimate is an upper bound); ``""`` when ``done`` is 0, nothing is left, or the elapsed time is not finite."""
    if done <= 0 or done >= total or not math.isfinite(elapsed_s) or elapsed_s < 0:
        return ""
    left = elapsed_s / done * (total - done)
    return f"{'<=' if bound else '~'}{format_seconds(left)} left"
