"""LoRA adapters on the Hugging Face policy, through peft.

:meth:`LoraAdapter.wrap` injects LoRA layers into a Hugging Face causal LM in place (peft's ``get_peft_model``):
every targeted linear layer becomes ``base_layer`` (frozen) plus ``lora_A`` / ``lora_B`` (trainable, fp32 even on a
bf16/fp16 base: peft's ``autocast_adapter_dtype``). The Hugging Face module itself (:attr:`LoraAdapter.model`) stays
the one the engine scores, generates and trains with, so the fused log-prob head (``model.model`` for the hidden
states, ``get_output_embeddings()`` for the head weight) and the shared-prefix scoring read it unchanged; the adapter
only adds a low-rank term inside the targeted layers.

What the engine asks of it:

- the reference model: the same module with its adapters disabled (:meth:`disabled`); ``lora_B`` starts at zero,
  so the frozen base is exactly the initial policy and no second copy of the weights is loaded;
- checkpoints: :meth:`adapter_state` / :meth:`adapter_config` in peft's own layout (the keys and the
  ``adapter_config.json`` that ``PeftModel.from_pretrained`` reads), :meth:`load_adapter_state` to resume, and
  :meth:`base_digest`, the SHA-256 of the frozen base's weights that a checkpoint names its base by (an adapter
  only means something over the weights it was trained on);
- exports and the generation engine's weights: :meth:`merged_state_dict`, the Hugging Face layout with every
  targeted weight ``W + scale * B A`` (computed in fp32, rounded once to the base's dtype, as peft's merge does),
  without touching the module (merging in place and unmerging would not give the bf16 base back bit for bit);
  :meth:`merged_copy`, a copy of the model in its plain architecture holding those weights (a generator that keeps
  its own copy: the int8 sampler).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

ADAPTER_NAME = "default"
LORA_KEY = ".lora_"  # in the state-dict keys of the adapter's own parameters (lora_A, lora_B, ...)
BASE_KEY = ".base_layer."  # where peft moves a targeted layer's own weight and bias


class LoraAdapter:
    """peft's LoRA model around a Hugging Face causal LM (build it with :meth:`wrap`)."""

    def __init__(self, peft_model: nn.Module) -> None:
        self.peft_model = peft_model
        self.model: nn.Module = peft_model.get_base_model()
        """The Hugging Face module with the LoRA layers injected (the one the policy trains)."""
        self.targets: list[str] = list(peft_model.base_model.targeted_module_names)
        self.target_set = set(self.targets)
        self._base_digest: str | None = None
        if not self.targets:
            raise ValueError("model.lora.target_modules: no layer of the model matches")

    @classmethod
    def wrap(
        cls, model: nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: Sequence[str]
    ) -> LoraAdapter:
        """Inject LoRA layers into ``model`` (in place; its own weights are frozen). ValueError when no layer
        matches ``target_modules`` (names are the layers' last components, or ``['all-linear']``).

        ``lora_A``'s random start is drawn from forked generators: the run's random stream is the one a full
        fine-tune of the same seed draws from, so both sample the same first batch (``lora_B`` starts at zero)."""
        from peft import LoraConfig, get_peft_model

        targets: str | list[str] = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
        config = LoraConfig(
            r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none", task_type="CAUSAL_LM"
        )
        dev = next(model.parameters()).device
        try:
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
                peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"model.lora.target_modules: {exc}") from None
        return cls(peft_model)

    def trainable(self) -> list[Tensor]:
        """The adapters' parameters (everything the optimizer holds)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def disabled(self) -> contextlib.AbstractContextManager:
        """A context in which :attr:`model` computes the frozen base (the reference model)."""
        return self.peft_model.disable_adapter()

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def adapter_state(self) -> dict[str, Tensor]:
        """The adapter's weights in peft's layout (``adapter_model.safetensors``'s keys), detached."""
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(self.peft_model).items()}

    def adapter_config(self) -> dict[str, Any]:
        """peft's ``adapter_config.json`` of this adapter (JSON values only)."""
        out = self.peft_model.peft_config[ADAPTER_NAME].to_dict()
        return json.loads(json.dumps(out, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))

    def load_adapter_state(self, state: dict[str, Tensor]) -> None:
        """Load :meth:`adapter_state`'s weights; ValueError naming what does not match."""
        from peft import set_peft_model_state_dict

        want = self.adapter_state()
        missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        bad = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
        if missing or unexpected or bad:
            raise ValueError(
                f"adapter does not match the model's LoRA layers (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}, other shape {bad[:3]}): was it written with another model.lora?"
            )
        set_peft_model_state_dict(self.peft_model, state)

    def base_digest(self) -> str:
        """``sha256:<hex>`` of the frozen base: every weight but the adapters', by its Hugging Face name in sorted
        order, with its dtype, shape and bytes (computed once: reading the weights costs about a second per GB)."""
        if self._base_digest is None:
            digest = hashlib.sha256()
            state = self.model.state_dict()
            for key in sorted(k for k in state if LORA_KEY not in k):
                value = state[key].detach()
                digest.update(f"{key.replace(BASE_KEY, '.')}\0{value.dtype}\0{tuple(value.shape)}\0".encode())
                digest.update(value.reshape(-1).cpu().contiguous().view(torch.uint8).numpy().data)
            self._base_digest = f"sha256:{digest.hexdigest()}"
        return self._base_digest

    # -- full weights ------------------------------------------------------------------------------------------------

    def merged_state_dict(self) -> dict[str, Tensor]:
        """The adapted model's weights in Hugging Face layout (tied weights under both names, as ``state_dict``)."""
        return dict(self.merged_weights())

    def merged_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) pairs of :meth:`merged_state_dict`, each targeted weight merged only when its turn comes
        (the generation engine's weight sync holds one merged weight at a time)."""
        for key, value in self.model.state_dict().items():
            if LORA_KEY in key:
                continue
            key = key.replace(BASE_KEY, ".")
            name, _, leaf = key.rpartition(".")
            if leaf != "weight" or name not in self.target_set:
                yield key, value.detach()
                continue
            with torch.no_grad():
                delta = self.model.get_submodule(name).get_delta_weight(ADAPTER_NAME)
                yield key, (value.float() + delta.float()).to(value.dtype)

    def merged_copy(self) -> nn.Module:
        """A copy of the Hugging Face model in its plain architecture (no LoRA layers) holding :meth:`merged_state_dict`
        (the module itself is not touched)."""
        plain = copy.deepcopy(self.peft_model).unload()  # the copy's LoRA layers replaced by their base layers
        plain.load_state_dict(self.merged_state_dict())  # strict: every weight, targeted ones merged
        for p in plain.parameters():
            p.requires_grad_(False)
        return plain

    @torch.no_grad()
    def load_merged(self, state: dict[str, Tensor]) -> tuple[list[str], list[str]]:
        """Load full Hugging Face weights as the base, with the adapters reset to zero (the model then computes
        exactly ``state``); returns (missing, unexpected) keys in Hugging Face names."""
        layers = {f"{name}.{leaf}" for name in self.targets for leaf in ("weight", "bias")}
        mapped = {}
        for key, value in state.items():
            name, _, leaf = key.rpartition(".")
            mapped[f"{name}{BASE_KEY}{leaf}" if key in layers else key] = value
        missing, unexpected = self.model.load_state_dict(mapped, strict=False)
        self._base_digest = None  # another base
        for name in self.targets:
            self.model.get_submodule(name).lora_B[ADAPTER_NAME].weight.zero_()
        missing = [k.replace(BASE_KEY, ".") for k in missing if LORA_KEY not in k]
        return missing, list(unexpected)
