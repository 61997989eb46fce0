"""The GPU check script, run on CPU (``--dry-run``: Triton interpreter, tiny shapes, the engine on CPU)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_check(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path / "cache"))  # the tiny models are built here
    return importlib.import_module("bench.gpu_check")


def test_gpu_check_dry_run_passes(gpu_check, tmp_path, capsys):
    out = tmp_path / "results.md"
    rc = gpu_check.main(["--dry-run", "--skip-timing", "--part", "kernels", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "FAIL" not in printed
    assert printed.count("[PASS]") == len(gpu_check.RESULTS) >= 20
    written = out.read_text()  # every printed line is in the results file too
    assert written.count("[PASS]") == len(gpu_check.RESULTS)
    assert f"kernels: {len(gpu_check.RESULTS)}/{len(gpu_check.RESULTS)} checks passed" in written
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by the fixture; restored after the test


def test_gpu_check_engine_budget_skips_cases(gpu_check, tmp_path, capsys):
    """Past the part's budget the remaining cases are reported as skipped (and the part fails), not run."""
    from bench.gpu_engine_check import engine_cases

    out = tmp_path / "results.md"
    rc = gpu_check.main(["--dry-run", "--part", "engine", "--budget", "0", "--out", str(out)])
    capsys.readouterr()
    assert rc == 1
    written = out.read_text()
    names = [n for n, _ in engine_cases()]
    assert {"grpo", "opsd", "sdar", "rlsd", "alignopsd_m1", "alignopsd_A", "alignopsd_E"} <= set(names)
    for n in names:
        assert f"[SKIP] engine {n}: past the part's budget" in written
    assert f"engine: 0/{len(names)} checks passed" in written


@pytest.mark.slow
def test_gpu_check_engine_dry_run(gpu_check, tmp_path, capsys):
    """The engine and scale parts on CPU: every estimator / ablation trains, with its phase table, appended to
    one results file part after part."""
    from bench.gpu_engine_check import engine_cases

    out = tmp_path / "results.md"
    rc = gpu_check.main(["--dry-run", "--part", "engine", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    rc = gpu_check.main(["--dry-run", "--part", "scale", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    written = out.read_text()
    names = [n for n, _ in engine_cases()]
    for n in names:
        line = next(ln for ln in written.splitlines() if ln.startswith(f"[PASS] engine {n}:"))
        assert "1 optimizer steps" in line and "phases rollout_generation" in line
        assert f"**{n}: 1 step(s), cpu**" in written
    assert "alignment phases (*)" in written
    assert written.count("| **step** |") == len(names) + 1  # one phase table per case, plus the scale step
    assert f"engine: {len(names)}/{len(names)} checks passed" in written
    assert "[PASS] engine alignopsd quickstart-like:" in written
    assert "alignment overhead over GRPO at this size:" in written
    # the cost model's prediction beside each measured phase of the quickstart-like step
    assert "| phase | measured s | share | predicted s | predicted / measured | within +-30% |" in written
    assert "[FAIL] cost model" not in written and "limits: " in written
    assert str(ROOT) not in written and str(tmp_path) not in written  # no machine paths in the results


def test_gpu_check_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--dry-run" in r.stdout and "--part" in r.stdout


def test_gpu_check_configs_part_dry_run(gpu_check, tmp_path, capsys):
    """The configs part on CPU: every kernel entry runs with its default configuration (no autotuning in the
    interpreter) and its time is printed beside the roofline bound of an A800."""
    from alignopsd.kernels.tuning import default_config

    out = tmp_path / "results.md"
    rc = gpu_check.main(["--dry-run", "--part", "configs", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    written = out.read_text()
    assert "autotune off (default configuration)" in written and "roofline peaks of the A800" in written
    for kernel in ("_lp_fwd_kernel", "_lp_bwd_kernel", "_sibling_kernel", "_pair_kernel"):
        row = next(ln for ln in written.splitlines() if ln.startswith(f"| {kernel} |"))
        assert default_config(kernel, 80).label() in row
        assert float(row.split("|")[5]) > 0  # the bound
        assert f"[PASS] configs {kernel}:" in written
    assert "configs: 4/4 checks passed" in written


def test_gpu_key_maps_names_and_architectures():
    from bench.gpu_configs import gpu_key

    assert gpu_key("NVIDIA A800-SXM4-80GB", 8) == "a800"
    assert gpu_key("NVIDIA H200", 9) == "h200"
    assert gpu_key("NVIDIA L40S", 8) == "a800" and gpu_key("NVIDIA GH100 unknown", 9) == "h200"
