"""A busy machine is named in a run's first lines (engine/parallel/load.py)."""

from __future__ import annotations

from alignopsd.engine.commands.train import machine_busy
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.parallel import load


def test_busy_line_compares_the_load_with_the_cores_the_run_leaves_free():
    assert load.busy_line(2, load=0.4, cpus=2) is None  # idle: the shell and a logger
    line = load.busy_line(2, load=2.6, cpus=2)
    assert line.startswith("[machine] busy: load 2.6 (1-minute average) on 2 CPU(s), and this run keeps 2 thread(s)")
    assert "other work holds about 2.6 of its cores" in line
    assert load.busy_line(2, load=3.0, cpus=8) is None  # six cores free: room for the other work
    assert "about 1.0 of its cores" in load.busy_line(4, load=5.0, cpus=8)


def test_the_train_command_counts_its_ranks_threads(monkeypatch):
    cfg = load_config("configs/tiny.yaml", ["trainer.torch_threads=1"])
    seen = []
    monkeypatch.setattr(load, "busy_line", lambda threads: seen.append(threads) or "busy")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert machine_busy(cfg) == "busy" and seen == [2]
