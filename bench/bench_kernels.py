"""pytest-benchmark microbenchmarks of the kernels: providers x modes (Liger-style).

    pytest bench/bench_kernels.py --benchmark-only [--benchmark-json FILE]

Providers: ``ours`` (``alignopsd.kernels``, torch path on CPU / Triton on CUDA), ``torch``
(plain torch), and for the alignment kernels ``loop`` (loop over tasks) and ``core`` (the
algorithm core's dense path). Modes for log-prob: ``fwd`` (no grad), ``fwdbwd`` (a training
step's head through the fused loss), ``fwdbwd_autograd`` (the autograd function). Sizes are the
``--quick`` sizes of ``bench.report`` so a run takes a couple of minutes on a CPU; the report
(``python -m bench.report``) adds peak memory and the CSV/markdown output.
"""

from __future__ import annotations

import pytest

from bench import kernel_cases as kc


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd", "fwdbwd_autograd"])
@pytest.mark.parametrize("model", ["smollm2", "qwen7b"])
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_logprob(benchmark, provider, model, mode):
    case = kc.logprob_case(model, mode, quick=True)
    fn = case.ours if provider == "ours" else case.base
    benchmark.group = f"logprob_{model}_{mode}"
    benchmark.extra_info.update(case.info)
    benchmark.pedantic(fn, rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("dim", [384, 1024])
@pytest.mark.parametrize("provider", ["ours", "loop", "core"])
def test_alignment(benchmark, provider, dim):
    batch = kc.alignment_batch(4, 8, 50, dim)
    fn = {"ours": kc.alignment_ours, "loop": kc.alignment_loop_baseline, "core": kc.alignment_core_dense}[provider]
    benchmark.group = f"alignment_kernels_d{dim}"
    benchmark.extra_info.update(dict(M=1600, D=dim))
    benchmark.pedantic(fn, args=(batch,), rounds=5, warmup_rounds=1)
