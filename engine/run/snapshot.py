"""The policy's training state, taken and put back in memory: weights, optimizer state and the generators' states.

``alignopsd ablate`` (engine/run/ablate.py) applies several estimators' updates from one starting point; between two
updates the policy goes back to that point through the same ``PolicyBackend`` methods a checkpoint uses
(engine/run/trainer.py ``save`` / ``load``):

* a full fine-tune: ``hf_state_dict`` / ``load_hf_state_dict`` and ``optimizer_state`` / ``load_optimizer_state``
  (AdamW's moments, the schedule, the step counters and, with bf16 weights, the fp32 master weights);
* LoRA adapters: the adapter's ``adapter_state`` / ``load_adapter_state`` and the optimizer state (the base is frozen);
* a sharded backend (Megatron): its own ``save_checkpoint`` / ``load_checkpoint`` into a scratch folder.

The in-memory copies are cloned to host memory (a backend hands out live views of its tensors). The generators'
states (python, numpy, torch, CUDA) are taken and put back beside them (engine/checkpoint/checkpoint.py), so an
update that draws random numbers draws the same ones each time. :meth:`PolicySnapshot.weight_hash` fingerprints the
trained parameters, to check that a restore restored.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.checkpoint.checkpoint import capture_rng_state, restore_rng_state
from alignopsd.engine.policy.base import PolicyBackend
from torch import Tensor

__all__ = ["PolicySnapshot", "host_copy", "trained_parameters", "weight_hash"]


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor inside (dicts, lists, tuples) cloned to host memory, the rest as it is."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


def trained_parameters(policy: PolicyBackend) -> list[tuple[str, Tensor]]:
    """The parameters the optimizer trains (``requires_grad``; LoRA: the adapters), by name, in the module's order."""
    return [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]


def weight_hash(policy: PolicyBackend) -> str:
    """SHA-256 (first 16 hex digits) of the trained parameters' names, shapes, dtypes and bytes."""
    h = hashlib.sha256()
    for name, p in trained_parameters(policy):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class PolicySnapshot:
    """The policy's weights, optimizer state and the generators' states at one point (see the module docstring).

    ``restore()`` puts them back (as often as asked) and checks the weights' hash against the one taken; ``close()``
    removes a sharded backend's scratch folder."""

    def __init__(self, policy: PolicyBackend) -> None:
        self.policy = policy
        self.scratch: Path | None = None
        self.weights: dict[str, Tensor] | None = None
        self.optimizer: dict[str, Any] | None = None
        if policy.sharded_checkpoint:
            self.scratch = Path(tempfile.mkdtemp(prefix="alignopsd-snapshot-"))
            policy.save_checkpoint(self.scratch / "policy")  # collective; its optimizer state included
        elif policy.adapter is not None:
            self.weights = host_copy(policy.adapter.adapter_state())
            self.optimizer = host_copy(policy.optimizer_state())
        else:
            self.weights = host_copy(policy.hf_state_dict())
            self.optimizer = host_copy(policy.optimizer_state())
        self.rng = capture_rng_state()
        self.hash = weight_hash(policy)

    def restore(self) -> str:
        """Put the weights, the optimizer state and the generators' states back; returns the restored weights' hash
        (:func:`weight_hash`), RuntimeError when it differs from the one taken (a backend whose checkpoint methods
        do not round-trip)."""
        policy = self.policy
        if self.scratch is not None:
            policy.load_checkpoint(self.scratch / "policy", verify=False)  # written by this process just before
        else:
            assert self.weights is not None and self.optimizer is not None
            if policy.adapter is not None:
                policy.adapter.load_adapter_state(self.weights)
            else:
                policy.load_hf_state_dict(self.weights)
            policy.load_optimizer_state(host_copy(self.optimizer))  # a copy: loading may keep what it is given
        policy.zero_grad()
        got = weight_hash(policy)
        if got != self.hash:
            raise RuntimeError(
                f"snapshot: the restored weights hash to {got}, the snapshot's to {self.hash}: "
                f"{type(policy).__name__}'s checkpoint methods did not restore its weights"
            )
        restore_rng_state(self.rng)
        return got

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
