"""The Megatron policy backend (``policy.backend: megatron``).

Legend: B = rows, T = Lp + L tokens per row, L = response length, N = scored response tokens,
D = hidden size, V = vocabulary, tp = tensor-parallel size.

The policy is a megatron-core ``GPTModel`` with tensor parallelism and data parallelism from
``megatron.core.parallel_state``, wrapped in megatron-core's ``DistributedDataParallel`` and
stepped by megatron-core's optimizer (``get_megatron_optimizer``: Adam with decoupled weight
decay, gradient clipping over all shards without counting tensor-parallel duplicates twice;
``use_distributed_optimizer`` shards its state over data-parallel ranks). Log-probabilities of
response tokens come from ``alignopsd.kernels.logprob_vocab_parallel`` on each rank's vocabulary
shard: no rank ever holds the full [N, V] logits, gathered or not.

Launch with ``torchrun``; world size = tp × data-parallel size. Without CUDA the backend applies
``cpu_shim`` (and only then), so the same code runs under gloo.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from alignopsd.engine.parallel.group import start_process_group
from alignopsd.engine.parallel.hardware import device_type
from alignopsd.engine.policy.base import ParallelLayout, check_loss_fn, check_optimizer_settings, prompt_width
from alignopsd.engine.policy.lm_head import fused_head_loss, scatter_response
from alignopsd.engine.policy.megatron import cpu_shim
from alignopsd.engine.policy.megatron.checkpointing import ShardCheckpoints
from alignopsd.engine.policy.megatron.convert import (
    Dims,
    conversion_parts,
    hf_to_megatron,
    megatron_part_to_hf,
    part_of,
)
from alignopsd.engine.policy.megatron.model import (
    build_gpt_model,
    forward_hidden,
    local_names,
    output_weight,
    te_names,
)
from alignopsd.engine.policy.megatron.scoring import ShardScoring
from torch import Tensor

log = logging.getLogger(__name__)


def init_parallel(tp: int, seed: int = 0) -> None:
    """Initialise torch.distributed (from torchrun's environment) and megatron's parallel state."""
    cpu_shim.apply_if_needed()
    if torch.cuda.is_available():  # before the group is made: NCCL's object collectives use the current device
        torch.cuda.set_device(int(__import__("os").environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        start_process_group(device_type("auto"))
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the world size {world}")
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != tp:
            raise ValueError(
                f"tensor_parallel_size: parallel state already initialised with tp="
                f"{ps.get_tensor_model_parallel_world_size()}, asked for {tp}"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)


def tensor_parallel_rank(tp: int, seed: int = 0) -> int:
    """This process's rank in its tensor-parallel group (parallel state initialised first: :func:`init_parallel`),
    known before any weight loads (rank 0 samples for its group and keeps the generation engine)."""
    init_parallel(tp, seed)
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    return int(ps.get_tensor_model_parallel_rank())


class MegatronPolicy(ShardScoring, ShardCheckpoints):
    """A megatron-core GPTModel as the trained policy (``PolicyBackend``).

    hf_config / hf_state_dict: the Hugging Face model to start from (every rank passes the full
    state dict; each keeps its shard). tp: tensor-parallel size. lr, weight_decay, betas, eps:
    Adam(W) settings. distributed_optimizer: shard optimizer state over data-parallel ranks.
    warmup_steps: linear learning-rate warm-up over this many optimizer steps, then constant (the Hugging Face
    backend's schedule: step k uses lr * min(1, (k + 1) / warmup_steps)), run by megatron-core's
    ``OptimizerParamScheduler``. recompute: activation recomputation, "none" | "full" | "selective"
    (``model.recompute_settings``).
    params_dtype: the model's parameter dtype; bf16/fp16 parameters are trained with fp32 main params and
    fp32 Adam state (megatron-core's mixed-precision optimizer), saved with the optimizer state.
    """

    def __init__(
        self,
        hf_config,
        hf_state_dict: dict[str, Tensor],
        *,
        tp: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        params_dtype: torch.dtype = torch.float32,
        distributed_optimizer: bool = False,
        layer_spec: str = "auto",
        seed: int = 0,
        warmup_steps: int = 0,
        recompute: str = "none",
    ) -> None:
        check_optimizer_settings(lr, weight_decay, warmup_steps)
        if distributed_optimizer and not torch.cuda.is_available():
            raise ValueError("distributed_optimizer: megatron-core's distributed optimizer needs CUDA parameters")
        init_parallel(tp, seed)
        self.hf_config = hf_config
        self.adapter = None  # no LoRA: the shards train the full weights (refused at config load)
        self.hf_model = None  # a full Hugging Face copy for generation, set by the run where it keeps one
        self.dims = Dims.from_hf_config(hf_config)
        pad = getattr(hf_config, "pad_token_id", None)
        self.padding_idx = int(pad) if pad is not None else None  # HF's embedding padding_idx (no lookup grad)
        self.tp = tp
        self.layout = parallel_layout(tp)
        self.tp_rank, self.tp_group, self.dp_group = self.layout.tp_rank, self.layout.tp_group, self.layout.dp_group
        self.distributed_optimizer = distributed_optimizer
        self.model, self.spec = build_gpt_model(hf_config, tp, params_dtype, layer_spec, recompute)
        self._copy_hf_weights(hf_state_dict)
        self.ddp = wrap_ddp(self.model, distributed_optimizer)
        self.betas, self.eps, self.params_dtype = betas, eps, params_dtype
        self.reset_optimizer(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps)

    def reset_optimizer(self, *, lr: float, weight_decay: float, warmup_steps: int) -> None:
        """megatron-core's optimizer (its fp32 main params copied from the current weights) and the warm-up schedule,
        started afresh with the step counters: what a policy built from these weights starts with."""
        check_optimizer_settings(lr, weight_decay, warmup_steps)
        self.ddp.zero_grad_buffer()
        self.optimizer = megatron_optimizer(
            self.ddp,
            lr=lr,
            weight_decay=weight_decay,
            betas=self.betas,
            eps=self.eps,
            params_dtype=self.params_dtype,
            distributed_optimizer=self.distributed_optimizer,
        )
        self.scheduler = warmup_scheduler(self.optimizer, lr, weight_decay, warmup_steps)
        self.steps = 0
        self.skipped_steps = 0

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------
    def _shard_state(self) -> dict[str, Tensor]:
        sd = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return local_names(sd)

    def load_hf_state_dict(self, hf: dict[str, Tensor]) -> None:
        """Load this rank's shard of a full Hugging Face state dict (in place); fp32 main params follow it."""
        self._copy_hf_weights(hf)
        self.optimizer.reload_model_params()

    def _copy_hf_weights(self, hf: dict[str, Tensor]) -> None:
        """Copy this rank's shard of ``hf`` into the model's parameters (ValueError names a mismatch)."""
        shard = hf_to_megatron(hf, self.dims, self.tp, self.tp_rank)
        if self.spec == "te":
            shard = te_names(shard)
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(shard))
        if missing:
            raise ValueError(f"state_dict: no value for megatron parameters {missing[:5]}")
        with torch.no_grad():
            for name, value in shard.items():
                if name not in params:
                    raise ValueError(f"state_dict: converted weight {name!r} has no megatron parameter")
                if params[name].shape != value.shape:
                    raise ValueError(
                        f"state_dict: {name} has shape {tuple(value.shape)}, expected {tuple(params[name].shape)}"
                    )
                params[name].copy_(value)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights in Hugging Face layout, gathered over the tensor-parallel group (every rank gets them)."""
        local = self._shard_state()
        out: dict[str, Tensor] = {}
        for part, names in self._parts(local):
            out.update(megatron_part_to_hf(self._gather(local, names, everywhere=True), self.dims, part))
        return out

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The full weights in Hugging Face layout as (name, tensor) pairs for the generation engine, gathered to
        the tensor-parallel group's first rank only and one conversion part at a time (the embedding, one layer,
        the final norm and head: ``convert.conversion_parts``): the first rank yields every weight, the group's
        other ranks send their shard of each part and yield nothing. The first rank holds at most one part's
        gathered pieces and its converted weights at once, never the full model.

        Collective over the tensor-parallel group: every rank must iterate it to the end, in step. A conversion
        that fails on the first rank does not stop its gathers (the group's other ranks would wait in the next
        one): it yields nothing more and raises the error after the last gather."""
        lead = self.tp_rank == 0
        local = self._shard_state()
        failed: Exception | None = None
        for part, names in self._parts(local):
            shards = self._gather(local, names, everywhere=False)
            if lead and failed is None:
                try:
                    hf = megatron_part_to_hf(shards, self.dims, part)
                except Exception as exc:  # noqa: BLE001 - raised after the group's last gather
                    failed = exc
                    continue
                del shards
                yield from hf.items()
                del hf
        if failed is not None:
            raise failed

    def _parts(self, local: dict[str, Tensor]) -> list[tuple[str | int, list[str]]]:
        """(conversion part, the names of ``local``, this rank's shard, that it converts from), in conversion
        order."""
        names: dict[str | int, list[str]] = {part: [] for part in conversion_parts(self.dims)}
        for name in sorted(local):
            part = part_of(name)
            if part is not None:
                names[part].append(name)
        return list(names.items())

    def _gather(
        self, local: dict[str, Tensor], names: list[str], *, everywhere: bool
    ) -> list[dict[str, Tensor]] | None:
        """The shards of every tensor-parallel rank for ``names`` of ``local`` (one dict per rank): on every rank
        (``everywhere``) or on the group's first rank only (None elsewhere). Collective over the group."""
        mine = {n: local[n].detach().contiguous() for n in names}
        if self.tp == 1:
            return [mine]
        gets = everywhere or self.tp_rank == 0
        shards: list[dict[str, Tensor]] = [{} for _ in range(self.tp)]
        for name in names:
            parts = [torch.empty_like(mine[name]) for _ in range(self.tp)] if gets else None
            if everywhere:
                dist.all_gather(parts, mine[name], group=self.tp_group)
            else:
                dist.gather(mine[name], parts, dst=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
            if gets:
                for r in range(self.tp):
                    shards[r][name] = parts[r]
        return shards if gets else None

    # ------------------------------------------------------------------------------------------
    # scoring
    # ------------------------------------------------------------------------------------------
    supports_fused_loss = True
    """``response_loss``: the vocab-parallel head's gradients are formed with the log-probs."""

    def response_loss(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_length: int,
        loss_fn,
        *,
        loss_fill: Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Training forward through the fused (vocab-parallel) head loss; the contract of
        ``HFPolicy.response_loss``: ([B, L] log-probs, [B, L] entropy or None, zero-valued gradient carrier).
        ``loss_fn`` must be a sum of per-token terms; every rank of the tensor-parallel group passes the same
        rows and loss."""
        lp = prompt_width(input_ids, attention_mask, response_length)
        check_loss_fn(loss_fn)
        input_ids, attention_mask = self._to_device(input_ids, attention_mask)
        rmask_BL = attention_mask[:, lp:].bool()
        self.model.train(True)
        hidden_BTD = forward_hidden(self.model, input_ids[:, :-1], attention_mask[:, :-1], self.padding_idx)
        h_BLD = hidden_BTD[:, lp - 1 :]
        weight = output_weight(self.model)
        tp = self.tp > 1

        def head(h_ND: Tensor, t_N: Tensor):
            return fused_head_loss(
                h_ND,
                weight,
                None,
                t_N,
                rmask_BL,
                loss_fn,
                loss_fill,
                temperature=temperature,
                with_entropy=with_entropy,
                group=self.tp_group if tp else None,
                vocab_start=self.tp_rank * int(weight.shape[0]) if tp else 0,
            )

        return scatter_response(h_BLD, input_ids[:, lp:], rmask_BL, head)

    # ------------------------------------------------------------------------------------------
    # optimisation
    # ------------------------------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the data-parallel gradient reduction (all micro-batches but the last)."""
        return self.ddp.no_sync()

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self, max_grad_norm: float | None) -> dict:
        """Reduce gradients over data parallel, clip over all shards, step; skip on a non-finite norm."""
        self.ddp.finish_grad_sync()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            log.warning("optimizer step skipped: gradient norm is %s", norm)
            self.skipped_steps += 1
            self.zero_grad()
            return {"grad_norm": norm, "skipped": True, "lr": lr}
        for opt in self.optimizers():
            opt.config.clip_grad = float(max_grad_norm) if max_grad_norm and max_grad_norm > 0 else 0.0
        ok, _, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(1)
        self.steps += 1
        self.zero_grad()
        return {"grad_norm": norm, "skipped": not ok, "lr": lr}


def parallel_layout(tp: int) -> ParallelLayout:
    """This rank's tensor- and data-parallel ranks and groups, from megatron's parallel state (initialised with
    ``tp`` first: :func:`init_parallel`)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    return ParallelLayout(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp,
        tp_group=tp_group,
        dp_rank=dist.get_rank(dp_group),
        dp_size=dist.get_world_size(dp_group),
        dp_group=dp_group,
    )


def wrap_ddp(model, distributed_optimizer: bool):
    """megatron-core's ``DistributedDataParallel`` around ``model``: gradients reduced in fp32, after the backward
    (no overlap); ``distributed_optimizer``: the buffers its sharded optimizer state needs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415

    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    return DistributedDataParallel(model.config, config, model)


def megatron_optimizer(
    ddp,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    params_dtype: torch.dtype,
    distributed_optimizer: bool,
):
    """megatron-core's Adam (decoupled weight decay, gradients clipped at norm 1 over all shards) over ``ddp``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: PLC0415

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=1.0,
        # bf16/fp16 parameters: megatron's mixed-precision optimizer keeps fp32 main params and
        # fp32 Adam state (the model's parameters are refreshed from them after each step). fp16
        # gets a constant loss scale of 1: the update scales nothing, as with bf16.
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        loss_scale=1.0 if params_dtype == torch.float16 else None,
        params_dtype=params_dtype,
        use_distributed_optimizer=distributed_optimizer,
    )
    return get_megatron_optimizer(config, [ddp])


def warmup_scheduler(optimizer, lr: float, weight_decay: float, warmup_steps: int):
    """megatron-core's ``OptimizerParamScheduler`` set to the Hugging Face backend's schedule: linear warm-up
    from 0, then constant. Megatron's warm-up gives lr * n / warmup_steps after n scheduler steps; the
    scheduler starts one step ahead so that optimizer step k (0-based) uses lr * min(1, (k + 1) / warmup_steps)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: PLC0415

    sched = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=warmup_steps + 1,
        lr_decay_style="constant",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    sched.step(1)
    return sched
