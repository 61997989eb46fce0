"""The Hugging Face generator over an int8 copy of the trained model (``generation.quantize``), for CPUs without
native bf16.

Where the policy computes in float32 on the CPU (``model.dtype: auto`` on an AVX2-only CPU), the forwards of
generation (rollouts, teacher samples, held-out evaluation) are most of a run's time, and their linear layers are
fp32 GEMMs. :class:`Int8Generator` samples from a copy of the model whose ``nn.Linear`` layers (attention and MLP
projections, and the LM head) hold int8 weights, one scale per output channel, and quantize their input per call
(dynamic quantization: FBGEMM's int8 GEMM, activations in 7 bits so that AVX2's int16 pair sums cannot saturate);
embeddings, norms, rotary positions, attention and the sampling stay fp32. On the AVX2 profile
(engine/parallel/cpu_profile.py) the int8 linear layers took 2-2.7x less time than fp32 at the quickstart's shapes
(bench/results/int8-generation-avx2-2026-12-03.md).

The method stays the one of a separate rollout engine (the vLLM backend; FP8 rollouts on GPUs): the trainer never
reads the int8 model. Old log-probs, teacher forcing and the update run on the fp32 policy, which recomputes the log-
probs of every sampled token; the gap between the two is measured every step (``mismatch/*``, the same metrics as for
any rollout engine) and corrected by ``trainer.ppo.rollout_is`` when it is on. After each update the weights the trainer
pushes (:meth:`Int8Generator.load_weights`) land in an fp32 copy, from which the int8 copy is quantized again, so the
sampler never runs on stale weights.

A LoRA policy (``model.lora``) trains adapters inside its targeted layers; the generator samples from its merged
weights (base + adapter, ``LoraAdapter.merged_copy``): the fp32 copy is the plain architecture, without LoRA layers,
so it is quantized like any other model and takes the merged weights the trainer pushes after each update.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.generation.hf import HFGenerator, copy_weights
from torch import Tensor, nn

if TYPE_CHECKING:
    from alignopsd.engine.policy.lora import LoraAdapter


def quantized_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (an fp32 CPU module, left untouched) whose ``nn.Linear`` layers hold int8 weights (per
    output channel, symmetric) and compute with dynamically quantized activations; no gradients."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if next(model.parameters()).dtype is not torch.float32:
        raise ValueError(f"int8 generation: quantizes a float32 model, got {next(model.parameters()).dtype}")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.ao's notice that eager quantization moves to torchao
        out = quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=False)
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()


class Int8Generator(HFGenerator):
    """:class:`HFGenerator` sampling from :func:`quantized_copy` of ``model`` (see the module doc).

    ``model`` is read once, at construction: the generator keeps its own fp32 copy (the target of
    :meth:`load_weights`) and the int8 copy quantized from it, so :func:`samples_from` is False for it and the trainer
    pushes its weights after each update. It keeps no prompt keys and values (:attr:`keeps_prompt_cache` is False):
    they would be the int8 model's, and the teacher forcing must score with the trained one.
    adapter: ``model``'s LoRA adapter (``adapter.model is model``), if it has one: the fp32 copy is then its merged
    weights in the plain architecture, which is what the trainer pushes (``PolicyBackend.hf_weights``).
    """

    def __init__(self, model: nn.Module, tokenizer, *, adapter: LoraAdapter | None = None, **kwargs) -> None:
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("generation.quantize=int8: int8 generation runs on the CPU (FBGEMM); this model is not")
        if adapter is not None and adapter.model is not model:
            raise ValueError("adapter: must be the LoRA adapter injected into this model (adapter.model is model)")
        self.float_model = (copy.deepcopy(model) if adapter is None else adapter.merged_copy()).eval()
        for p in self.float_model.parameters():
            p.requires_grad_(False)
        super().__init__(quantized_copy(self.float_model), tokenizer, **kwargs)
        self.quantizations = 1  # int8 copies made so far (one per weight sync, and the first)

    @property
    def keeps_prompt_cache(self) -> bool:
        return False

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Copy ``state_dict`` (HF names) into the fp32 copy and quantize the int8 copy from it again."""
        copy_weights(self.float_model, state_dict)
        self.model = quantized_copy(self.float_model)
        self.quantizations += 1
