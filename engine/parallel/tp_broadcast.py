"""The tensor-parallel group's broadcast: its first rank runs a part, the others receive what it produced.

The ranks of a tensor-parallel group must train on the same batch. Sampling is not bitwise reproducible across
processes on GPUs (vLLM, one engine per rank), and an environment can time out on one rank and not on another, so
"every rank samples the same thing" is not something to rely on. Instead the group's first rank (tensor-parallel
rank 0) runs each sampling part and broadcasts what it produced over the group (:func:`broadcast_from_lead`,
``broadcast_object_list``; on CPU tensors, so it works under gloo and NCCL alike). The step's sampling parts built on
it (the rollout, the teacher pass's generation and encoding) are the step's: engine/step/group_sampling.py.

The data-dependent decisions after it are made once per group too, on its first rank, and broadcast: the M1 pair
selection (similarity matrix, eligibility, pairs: ``teacher_pass.mechanism1``) and the estimator's output (M2's
spans and the token advantages: ``step.estimate``). On GPUs these use atomics (``index_add_``), so two ranks
recomputing them could pick different pairs or spans and run different forwards inside one tensor-parallel step.
Everything else (old log-probs, teacher forcing through the sharded model, the update) runs on every rank of the
group with identical inputs. A part that only the first rank can fail in, after collectives every rank takes part
in (the weight sync), shares its outcome with :func:`share_lead_outcome`. Without tensor parallelism (no group, or a
group of one) every function here is the plain call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from alignopsd.engine.parallel.collectives import collective_device
from torch import Tensor


def tp_layout(policy) -> tuple[Any, int]:
    """(tensor-parallel process group, global rank of its first rank), or (None, 0) without tensor parallelism."""
    layout = policy.layout
    if not layout.tensor_parallel:
        return None, 0
    import torch.distributed as dist

    return layout.tp_group, dist.get_global_rank(layout.tp_group, 0)


def is_group_lead(policy) -> bool:
    """True on the rank that samples for its tensor-parallel group (and always without tensor parallelism)."""
    return policy.layout.is_group_lead


def move_to(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor (also inside dataclass fields, named tuples, lists, tuples and dicts) on
    ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(move_to(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(v, device) for v in obj)
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        import dataclasses

        changes = {f.name: move_to(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def _to_cpu(obj: Any) -> Any:
    return move_to(obj, "cpu")


class LeadRankError(RuntimeError):
    """Raised on the other ranks of a tensor-parallel group when its first rank failed in a part it runs for
    the group (sampling, the weight sync); the message carries the first rank's error."""


class _LeadFailure:
    """What the group's first rank broadcasts instead of a result when it failed (picklable, never the
    exception object itself, which may not be)."""

    def __init__(self, exc: BaseException, src: int) -> None:
        self.text = f"{type(exc).__name__}: {exc}"
        self.src = src

    def error(self) -> LeadRankError:
        return LeadRankError(
            f"the first rank (global rank {self.src}) of this tensor-parallel group failed: {self.text}"
        )


def broadcast_from_lead(policy, make: Callable[[], Any], device: torch.device | None = None) -> Any:
    """``make()`` on the group's first rank, its result (tensors on the CPU, or on ``device`` when given) on every
    rank of the group, the first included (so every rank holds the same bits).

    Every rank of the group must call this at the same point; only the first one calls ``make``. If ``make``
    raises there, the first rank sends the error instead of a result and every rank of the group raises at once
    (the first rank its own exception, the others :class:`LeadRankError` with its text) instead of waiting in
    the broadcast until the collective times out."""
    group, src = tp_layout(policy)
    if group is None:
        return make()
    import torch.distributed as dist

    failure: BaseException | None = None
    box: list[Any] = [None]
    if is_group_lead(policy):
        try:
            box[0] = _to_cpu(make())
        except Exception as exc:  # noqa: BLE001 - sent to the group, then raised here too
            failure, box[0] = exc, _LeadFailure(exc, src)
    dist.broadcast_object_list(box, src=src, group=group, device=collective_device(group))
    if failure is not None:
        raise failure
    if isinstance(box[0], _LeadFailure):
        raise box[0].error()
    return box[0] if device is None else move_to(box[0], device)


def share_lead_outcome(policy, error: BaseException | None) -> None:
    """After a collective part that only the group's first rank can fail in (the weight sync's consumer): every
    rank learns whether it failed; then the first rank re-raises ``error`` and the others raise
    :class:`LeadRankError`. Every rank of the group calls it at the same point (all earlier collectives of the
    part completed); a no-op without tensor parallelism."""
    group, src = tp_layout(policy)
    if group is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    box: list[Any] = [_LeadFailure(error, src) if (is_group_lead(policy) and error is not None) else None]
    dist.broadcast_object_list(box, src=src, group=group, device=collective_device(group))
    if error is not None:
        raise error
    if isinstance(box[0], _LeadFailure):
        raise box[0].error()
