"""The AVX2 CPU profile (`make run-avx2`): every library that dispatches by the CPU is held to AVX2 in the process it
starts, and ``model.dtype: auto`` picks float32 there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from alignopsd.engine.commands.cpu_profile import main as cpu_profile_main
from alignopsd.engine.parallel import cpu_profile
from alignopsd.engine.parallel.hardware import CPUINFO, parse_cpu_flags

ROOT = Path(__file__).resolve().parents[2]

# Run in the profiled process: torch's capability, the dtype rule, and FBGEMM's int8 GEMM on a product that an AVX2
# kernel (vpmaddubsw: adjacent lanes summed in saturating int16) computes differently from exact arithmetic
# (VNNI): 64 lanes of 255 x -128, exactly -16320 after scaling, -8192 when every lane pair saturates.
PROBE = """
import json, torch
from alignopsd.engine.parallel.hardware import choose_dtype
x = torch.full((1, 64), 255.0)
w = torch.quantize_per_tensor(torch.full((4, 64), -1.0), 1.0 / 128, 0, torch.qint8)
y = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(w, None), False)
print(json.dumps({"cap": torch.backends.cpu.get_cpu_capability(), "dtype": choose_dtype("auto", "cpu").name,
                  "int8": float(y[0, 0])}))
"""


def _x86_avx2() -> bool:
    try:
        return "avx2" in parse_cpu_flags(CPUINFO.read_text(errors="replace"))
    except OSError:
        return False


def test_profile_env_sets_every_variable_and_refuses_unknown_names():
    env = cpu_profile.profile_env("avx2", base={"PATH": "/bin", "ALIGNOPSD_CPU_FLAGS": "avx512_bf16"})
    assert env["PATH"] == "/bin" and env["ALIGNOPSD_CPU_FLAGS"] == ""
    for key in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS"):
        assert env[key].lower() == "avx2"
    with pytest.raises(ValueError, match="unknown 'avx3'; known: avx2"):
        cpu_profile.profile_env("avx3")
    assert cpu_profile_main(["avx3", "--", "true"]) == 2
    assert cpu_profile_main(["avx2", "true"]) == 2


def test_make_run_avx2_is_make_run_under_the_profile():
    text = (ROOT / "Makefile").read_text()
    run = re.search(r"^RUN := (.+)$", text, re.M).group(1)
    assert "sft --pipeline --easy-games --config configs/quickstart_cpu.yaml" in run
    assert re.search(r"^run: install\n\t\$\(RUN\)$", text, re.M)
    assert re.search(
        r"^run-avx2: install\n\t\$\(BIN\)/python -m alignopsd\.engine\.commands\.cpu_profile avx2 -- \$\(RUN\)$",
        text,
        re.M,
    )


@pytest.mark.skipif(not _x86_avx2(), reason="needs an x86 CPU with AVX2")
def test_the_profiled_process_computes_as_an_avx2_cpu():
    cmd = [sys.executable, "-m", "alignopsd.engine.commands.cpu_profile", "avx2", "--", sys.executable, "-c", PROBE]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert res.stdout.startswith("[cpu profile] avx2: ATEN_CPU_CAPABILITY='avx2'")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["cap"] == "AVX2"
    assert out["dtype"] == "float32"
    assert out["int8"] == pytest.approx(-8192.0)  # FBGEMM's AVX2 kernel, not VNNI's exact -16320
