"""Checkpoints of the Megatron backend: its sharded save and load (torch.distributed.checkpoint) and the gathered
optimizer state of a plain checkpoint.

:class:`ShardCheckpoints` is mixed into ``MegatronPolicy`` (engine/policy/megatron/backend.py), which sets ``model``,
``optimizer``, ``scheduler``, ``tp``, ``tp_rank``, ``tp_group``, ``dims``, ``spec``, ``distributed_optimizer``,
``steps`` and ``skipped_steps``. A sharded checkpoint folder holds DCP's files, ``layout.json`` (the model and
parallel layout it was written for) and its manifest (engine/checkpoint/manifest.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from alignopsd.engine.checkpoint import safe_dcp
from alignopsd.engine.checkpoint.manifest import file_entry, read_manifest, verify_manifest, write_manifest
from alignopsd.engine.parallel.tp_broadcast import move_to
from torch import Tensor

LAYOUT_FILE = "layout.json"  # of a sharded checkpoint folder: the model and layout it was written for


class ShardCheckpoints:
    """The checkpoint half of the ``PolicyBackend`` contract for a tensor-parallel megatron-core model."""

    def _dcp_state(self) -> dict[str, Any]:
        """Keys name the tensor-parallel rank, never the data-parallel one: data-parallel replicas
        write one copy, and a checkpoint loads at any data-parallel size (same tp). With the distributed
        optimizer its parameter state (fp32 main params, Adam moments), sharded over data-parallel ranks, is
        gathered into one (``get_parameter_state_dp_zero``), so that it reshards like the rest."""
        prefix = f"tp{self.tp_rank}of{self.tp}"
        opt = self.optimizer.state_dict()
        state = {
            f"{prefix}/model": self.model.state_dict(),
            f"{prefix}/optimizer": opt,
            f"{prefix}/scheduler_steps": torch.tensor(self.scheduler.num_steps),
            "steps": torch.tensor(self.steps),
            "skipped_steps": torch.tensor(self.skipped_steps),
        }
        if self.distributed_optimizer:
            state[f"{prefix}/param_state"] = [
                o.get_parameter_state_dp_zero(return_on_all_ranks=True) for o in self.optimizers()
            ]
        return state

    def checkpoint_layout(self) -> dict[str, Any]:
        """What a sharded checkpoint must match to load here (``layout.json`` of the folder)."""
        return {
            "tensor_parallel_size": self.tp,
            "dims": dataclasses.asdict(self.dims),
            "params_dtype": str(self.model.config.params_dtype),
            "distributed_optimizer": self.distributed_optimizer,
            "layer_spec": self.spec,
        }

    sharded_checkpoint = True
    """Checkpoints hold the sharded state (:meth:`save_checkpoint`), with a Hugging Face export only when asked."""

    def local_state(self) -> dict[str, Tensor]:
        """This rank's shard of the weights (megatron names), checked for NaN/inf before a sharded save."""
        return self.model.state_dict()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Sharded save (torch.distributed.checkpoint) and ``layout.json``, then the folder's manifest
        (checkpoint/manifest.py), written last by the first rank once every rank has written (and checksummed) its
        files. Collective: every rank calls it with the same path."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        dcp.save(self._dcp_state(), checkpoint_id=str(path))
        dist.barrier()
        folder = Path(path)
        mine = {p.name: file_entry(p) for p in sorted(folder.glob(f"__{dist.get_rank()}_*.distcp"))}
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        if dist.get_rank() == 0:
            (folder / LAYOUT_FILE).write_text(json.dumps(self.checkpoint_layout(), indent=1, sort_keys=True))
            write_manifest(folder, {k: v for part in parts for k, v in part.items()})
        dist.barrier()

    def check_checkpoint_layout(self, path: str | os.PathLike) -> None:
        """ValueError naming every difference when the sharded checkpoint at ``path`` was written for another
        model or parallel layout (it reshards over data-parallel ranks only); reads ``layout.json`` only."""
        try:
            saved = json.loads((Path(path) / LAYOUT_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"sharded checkpoint {path}: {LAYOUT_FILE} is unreadable ({exc})") from None
        mine = self.checkpoint_layout()
        diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in mine.items() if saved.get(k) != v]
        if diff:
            raise ValueError(
                f"sharded checkpoint {path} does not fit this model and parallel layout (a sharded checkpoint loads "
                f"into the same model, dtype and tensor-parallel size, at any data-parallel size): {'; '.join(diff)}"
            )

    def _materialize_optimizer_state(self) -> None:
        """Give every parameter its Adam state (zeros) so that a checkpoint can be loaded into it in place."""
        for opt in self.optimizers():
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    st = inner.state[p]
                    if not st:
                        st["step"] = torch.tensor(0.0)
                        st["exp_avg"] = torch.zeros_like(p.data)
                        st["exp_avg_sq"] = torch.zeros_like(p.data)

    def load_checkpoint(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        """Sharded load; the folder's manifest is verified first (``verify=False``: the caller has just verified
        it, the trainer's checkpoint manifest lists these files too), so no file (DCP's pickled ``.metadata``
        included) is read unless it is the one that was written; then its layout is checked against this model
        before any shard is read. DCP's pickles are read through checkpoint/safe_dcp.py (a restricted unpickler for
        ``.metadata``, ``weights_only`` for non-tensor values): a forged file is refused, never run."""
        if verify:
            verify_manifest(path, require=(".metadata", LAYOUT_FILE))
        self.check_checkpoint_layout(path)
        self._materialize_optimizer_state()
        state = self._dcp_state()
        safe_dcp.load(state, path, set(read_manifest(path)))  # DCP's pickles through a restricted unpickler
        prefix = f"tp{self.tp_rank}of{self.tp}"
        self.model.load_state_dict(state[f"{prefix}/model"], strict=False)
        self.optimizer.load_state_dict(state[f"{prefix}/optimizer"])
        if self.distributed_optimizer:
            for opt, param_state in zip(self.optimizers(), state[f"{prefix}/param_state"]):
                opt.load_parameter_state_from_dp_zero(param_state)
        self._set_scheduler_steps(int(state[f"{prefix}/scheduler_steps"]))
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def _set_scheduler_steps(self, num_steps: int) -> None:
        self.scheduler.num_steps = 0
        self.scheduler.step(num_steps)

    def optimizers(self) -> list:
        """megatron-core's optimizers behind ``self.optimizer`` (one per parameter dtype group when chained)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer state of every tensor-parallel rank, gathered (identical on all ranks), for the
        trainer's single-file checkpoint. Data-parallel replicas hold the same state; with the distributed
        optimizer each holds a shard, and the shards of the data-parallel group are gathered into one
        (``get_parameter_state_dp_zero``), so a checkpoint loads at any data-parallel size with the same ``tp``."""
        local: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.distributed_optimizer:
            local["param_state"] = [o.get_parameter_state_dp_zero(return_on_all_ranks=True) for o in self.optimizers()]
        states: list[Any] = [None] * self.tp
        if self.tp == 1:
            states = [local]
        else:
            # on the CPU: a pickled CUDA tensor is rebuilt on the sender's device index, which another rank may
            # not see (one visible GPU per process) or should not allocate on
            dist.all_gather_object(states, move_to(local, "cpu"), group=self.tp_group)
        return {
            "tp": self.tp,
            "tp_rank_states": states,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "scheduler_steps": self.scheduler.num_steps,
        }

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state`'s state (also as a plain checkpoint of an earlier version stored it,
        under ``backend_state``); ValueError when it was saved at another tensor-parallel size."""
        state = state.get("backend_state", state)
        if int(state.get("tp", -1)) != self.tp:
            raise ValueError(f"optimizer_state: saved at tensor_parallel_size={state.get('tp')}, running at {self.tp}")
        self._materialize_optimizer_state()
        local = state["tp_rank_states"][self.tp_rank]
        if "optimizer" not in local:  # a checkpoint written before the state carried its parts by name
            local = {"optimizer": local}
        if self.distributed_optimizer and "param_state" not in local:
            raise ValueError(
                "optimizer_state: saved without the distributed optimizer; policy.distributed_optimizer "
                "must match the run that wrote the checkpoint"
            )
        self.optimizer.load_state_dict(local["optimizer"])
        if self.distributed_optimizer:
            for opt, param_state in zip(self.optimizers(), local["param_state"]):
                opt.load_parameter_state_from_dp_zero(param_state)
        self._set_scheduler_steps(int(state.get("scheduler_steps", 1)))
        self.steps = int(state.get("steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
