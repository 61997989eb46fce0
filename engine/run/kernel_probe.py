"""The run's custom CPU kernels, chosen by measured speed before its first step (kernels/native_choice.py).

:func:`choose_cpu_kernels` times each C++ kernel against the torch path it replaces at the model's own shapes, in
the model's dtype and with the run's threads, and returns one line per kernel for the run's first lines:

- the LM head's partials (the fused log-prob and loss of every scoring and update pass): ``PROBE_ROWS`` token
  rows against the model's head ``[V, H]`` (at most ``PROBE_VOCAB`` rows of it: the rate does not depend on the
  vocabulary's length past a few tiles, and a 7B model's head need not be copied);
- the LM head's GEMMs on bf16 operands with fp32 results against fp32 tiles (the logits tile and the backward's two
  GEMMs of one chunk of the fused loss, ``kernels/head/bf16_gemm.py``): ``PROBE_ROWS`` rows against ``GEMM_PROBE_VOCAB``
  rows of the head, measured before the head's partials, whose torch path takes the chosen GEMM;
- the shared-prefix prefill attention (the teacher forcing behind kept prompts): ``ATTENTION_ROWS`` rows of
  ``ATTENTION_QUERIES`` queries over ``ATTENTION_PREFIX`` prefix and as many own positions, the model's heads;
Packed against padded rows (``trainer.ppo.use_remove_padding: auto`` on a CPU) is not probed here: the run's first
update times them on its own micro-batches, forward and backward (engine/step/packing_trial.py), and the policy's
``RowLayout`` holds the choice.

A kernel already chosen in this process (an earlier policy build, a first use) keeps its choice. On an accelerator
there is nothing to choose (the Triton kernels run there), and a kernel that cannot run here says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from alignopsd.kernels.attention_native import measure_attention
from alignopsd.kernels.head.cpu_partials import measure_head
from alignopsd.kernels.head.gemm_choice import measure_head_gemm
from alignopsd.kernels.native_choice import ATTENTION, HEAD, HEAD_GEMM, LABELS, KernelChoice, recorded

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PROBE_ROWS, PROBE_VOCAB = 256, 32768
GEMM_PROBE_VOCAB = 8192  # three GEMMs per call: a quarter of the partials' probe keeps it as short
# the quickstart's teacher forcing: rows of ~45-56 queries behind ~670-690 kept prompt positions
ATTENTION_ROWS, ATTENTION_QUERIES, ATTENTION_PREFIX = 4, 48, 640


def choose_cpu_kernels(
    hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> list[str]:
    """Measure (or read back) the choice of each custom CPU kernel for a model of ``hf_config`` in ``dtype`` and
    return the lines that state it; none on an accelerator."""
    if torch.device(device).type != "cpu":
        return []
    lines = []
    for kernel, probe in ((HEAD_GEMM, _gemm_probe), (HEAD, _head_probe), (ATTENTION, _attention_probe)):
        choice = recorded(kernel)
        if choice is None and dtype != torch.bfloat16:
            run_dtype = str(dtype).removeprefix("torch.")
            plain = LABELS.get(kernel, ("", "torch path"))[1]
            lines.append(f"{kernel}: {plain} (the model runs in {run_dtype}; the custom path is for bf16)")
            continue
        lines.append((choice or probe(hf_config, dtype)).describe())
    return lines


def _head_probe(hf_config: PretrainedConfig, dtype: torch.dtype) -> KernelChoice:
    g = torch.Generator().manual_seed(0)
    hidden, vocab = hf_config.hidden_size, min(hf_config.vocab_size, PROBE_VOCAB)
    h = torch.randn(PROBE_ROWS, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dtype)
    t = torch.randint(0, vocab, (PROBE_ROWS,), generator=g)
    return measure_head(h, w, None, t)


def _gemm_probe(hf_config: PretrainedConfig, dtype: torch.dtype) -> KernelChoice:
    g = torch.Generator().manual_seed(0)
    hidden, vocab = hf_config.hidden_size, min(hf_config.vocab_size, GEMM_PROBE_VOCAB)
    h = torch.randn(PROBE_ROWS, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dtype)
    return measure_head_gemm(h, w)


def _attention_probe(hf_config: PretrainedConfig, dtype: torch.dtype) -> KernelChoice:
    g = torch.Generator().manual_seed(0)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    d = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    b, s, p = ATTENTION_ROWS, ATTENTION_QUERIES, ATTENTION_PREFIX
    q = torch.randn(b, s, heads, d, generator=g).to(dtype).transpose(1, 2)  # [B, H, S, D], strided as the model's
    k, v = (torch.randn(b, kv_heads, s, d, generator=g).to(dtype).float() for _ in range(2))  # the cache keeps fp32
    pk, pv = (torch.randn(1, kv_heads, p, d, generator=g).to(dtype).float() for _ in range(2))
    causal = torch.full((s, s), float("-inf")).triu(1)
    bias = torch.cat([torch.zeros(s, p), causal], dim=1).expand(b, 1, s, p + s).contiguous()
    return measure_attention(q, k, v, pk, pv, torch.zeros(b, dtype=torch.long), bias, d**-0.5)
