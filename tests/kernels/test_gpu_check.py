"""The GPU check script's correctness pass, run on CPU under the Triton interpreter with tiny shapes."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_passes(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    gpu_check = importlib.import_module("bench.gpu_check")
    rc = gpu_check.main(["--dry-run", "--skip-timing"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out
    assert out.count("[PASS]") == len(gpu_check.RESULTS) >= 20
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by the fixture; restored after the test


def test_gpu_check_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--dry-run" in r.stdout
