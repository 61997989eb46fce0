"""The ahead-of-time compile check (bench/kernel_compile.py) and the configurations it checks (kernels/tuning.py)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from alignopsd.kernels.tuning import (
    ARCHS,
    CONFIGS,
    GPUS,
    autotune_enabled,
    configs_for,
    default_config,
    max_meta,
    roofline,
)

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


@pytest.fixture
def kc(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("bench.kernel_compile")


def test_every_kernel_has_configurations_for_both_architectures(kc):
    from bench.kernel_specs import SPECS

    assert {s.name for s in SPECS} == set(CONFIGS)
    for spec in SPECS:
        fn = spec.function()
        for arch in ARCHS:
            cfgs = configs_for(spec.name, arch)
            assert 2 <= len(cfgs) <= 4 and default_config(spec.name, arch) == cfgs[0]
            for c in cfgs:  # every BLOCK constexpr is a kernel parameter, every other parameter has a type
                params = set(fn.__code__.co_varnames[: fn.__code__.co_argcount])
                assert set(c.meta) | set(spec.flags("bf16")) | set(spec.types("bf16")) == params
    assert max_meta("_lp_fwd_kernel", "BLOCK_V") == 128
    with pytest.raises(ValueError, match="unknown name"):
        configs_for("_nope", 80)
    assert not autotune_enabled()  # the interpreter (tests) never autotunes


def test_occupancy_from_registers_shared_memory_and_warps(kc):
    assert kc.occupancy(80, 255, 49152, 8) == 8 / 64  # 8,192 registers a warp: 8 warps fit, one block
    assert kc.occupancy(80, 128, 0, 4) == 16 / 64
    assert kc.occupancy(90, 64, 0, 4) == 32 / 64
    assert kc.occupancy(80, 32, 80000, 4) == 8 / 64  # two blocks by shared memory


def test_problems_flag_spills_in_engine_half_configurations_only(kc):
    R = kc.Record
    ok = R("k", "bf16", 80, "c", True, regs=200)
    spill = R("k", "bf16", 90, "c", True, regs=255, local_bytes=8)
    fp32_spill = R("k", "fp32", 80, "c", True, regs=255, local_bytes=8)
    comparison = R("k", "fp16", 80, "old", False, regs=255, local_bytes=680)
    smem = R("k", "fp32", 80, "big", False, smem_bytes=200_000)
    broken = R("k", "bf16", 80, "c", True, error="CompilationError: x")
    found = kc.problems([ok, spill, fp32_spill, comparison, smem, broken])
    assert found == [
        "k bf16 sm_90 [c]: 8 B of local memory per thread (register spills)",
        "k fp32 sm_80 [big]: shared memory 200000 B over the 166912 B limit",
        "k bf16 sm_80 [c]: compile error: CompilationError: x",
    ]


def test_compile_check_passes_from_the_committed_cache(kc, tmp_path, capsys):
    """Every row of the committed results is current (same kernel sources) and none fails the check."""
    cache = tmp_path / "cache.json"
    shutil.copy(kc.DEFAULT_CACHE, cache)
    out = tmp_path / "table.md"
    rc = kc.main(["--out", str(out), "--cache", str(cache)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out[-2000:]
    assert "compiled " not in captured.err  # all cached: the committed file matches the sources
    assert json.loads(cache.read_text()) == json.loads(kc.DEFAULT_CACHE.read_text())
    table = out.read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| _")]
    assert len(rows) == len(list(kc.jobs()))
    for name in CONFIGS:
        for arch in ARCHS:
            assert any(r.startswith(f"| {name} |") and f"sm_{arch}" in r for r in rows)
    assert "no local memory in an engine configuration" in table


_COMPILE_ONE = """
import importlib, json
from alignopsd.kernels.tuning import ARCHS, default_config
from bench import kernel_compile as kc
from bench.kernel_specs import SPECS

fn = importlib.import_module("alignopsd.kernels.jsd_boundary")._pair_kernel
spec = next(s for s in SPECS if s.name == "_pair_kernel")
out = []
for arch in ARCHS:
    cfg = default_config("_pair_kernel", arch)
    out.append(kc.compile_one(fn, spec.types("fp32"), dict(cfg.meta), arch, cfg.num_warps, 3))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_one_kernel_compiles_for_both_architectures():
    """The real pipeline down to a cubin and cuobjdump, without a GPU (the pair kernel: the smallest). In a process
    of its own: the interpreter the other kernel tests run under patches triton's language in this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", _COMPILE_ONE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == len(ARCHS)
    for regs, local, smem in rows:
        assert 16 <= regs <= 255 and local == 0 and smem >= 0


def test_roofline_bounds_follow_peaks_and_bytes():
    N, V, H = 8192, 151936, 2048
    for gpu, g in GPUS.items():
        fwd = roofline("_lp_fwd_kernel", (N, V, H), gpu)
        assert fwd["flops"] == 2.0 * N * V * H
        assert fwd["bound_ms"] == pytest.approx(fwd["flops"] / (g.tflops * 1e9))  # compute-bound
        pair = roofline("_pair_kernel", (6400, 400), gpu)
        assert pair["bound_ms"] == pytest.approx(10.0 * 6400 * 400 / (g.tbps * 1e9))  # bandwidth-bound
        bwd = roofline("_lp_bwd_kernel", (N, V, H), gpu)
        assert bwd["intensity"] < g.tflops / g.tbps  # below the ridge: bound by its atomic traffic
    with pytest.raises(ValueError, match="gpu"):
        roofline("_lp_fwd_kernel", (1, 1, 1), "v100")


def test_kernel_compile_help_runs():
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "bench.kernel_compile", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0 and "--cache" in r.stdout


@pytest.mark.parametrize("need_weight_grad", [False, True])
def test_autotuner_reset_buffers_alias_no_other_argument(monkeypatch, need_weight_grad):
    """The autotuner zeroes the backward's gradient arguments between benchmark runs: none of them may share
    memory with another argument (an unused gradient once pointed at lse)."""
    import inspect

    import torch
    from alignopsd.kernels import logprob
    from alignopsd.kernels.tuning import RESET_TO_ZERO

    lp_mod = importlib.import_module("alignopsd.kernels.head.logprob_triton")  # the launchers of logprob
    seen = []
    original = lp_mod.launch_tuned

    def capture(fn, grid, device, *args, **kwargs):
        seen.append((fn, inspect.signature(fn).bind_partial(*args).arguments))
        return original(fn, grid, device, *args, **kwargs)

    monkeypatch.setattr(lp_mod, "launch_tuned", capture)
    h = torch.randn(5, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=need_weight_grad)
    logprob(h, w, torch.randint(0, 40, (5,)), impl="triton", with_entropy=True)[1].sum().backward()
    fn, bound = next((f, b) for f, b in seen if f.__name__ in RESET_TO_ZERO)
    tensors = {k: v for k, v in bound.items() if isinstance(v, torch.Tensor)}
    for name in RESET_TO_ZERO[fn.__name__]:
        ptr = tensors[name].untyped_storage().data_ptr()
        others = [k for k, v in tensors.items() if k != name and v.untyped_storage().data_ptr() == ptr]
        assert not others, f"{name} shares memory with {others}"
