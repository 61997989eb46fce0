"""What ``bench.kernel_compile`` compiles: each Triton kernel's argument types per operand dtype, the constexpr
flags the engine launches it with on CUDA, and configurations shown beside the engine's for comparison.

Argument types follow triton's signature strings (``*bf16`` pointer, ``i32``, ``fp32``); a trailing ``!`` marks
an argument the launches pass 16-byte aligned / divisible by 16 (pointers from torch allocations; the hidden
size, vocabulary, strides and embedding size of the paper's models), which triton specializes on and which
changes the code (vectorized loads, pipelining) and so the registers.

Flags are the CUDA values (``UPCAST=False``: operands go to ``tl.dot`` in their own dtype; ``DOT_PREC`` "ieee"
for fp32, "tf32" otherwise). The log-prob kernels are compiled with the widest flag set the engine uses on a
model without LM-head bias (Qwen2.5 and SmolLM2 heads have none): forward plain, backward with the entropy
gradient and both hidden and weight gradients.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from alignopsd.kernels.tuning import KernelConfig

DTYPES = ("fp32", "bf16", "fp16")


def _prec(dt: str) -> str:
    return "ieee" if dt == "fp32" else "tf32"


def _lp_fwd_types(dt: str) -> dict[str, str]:
    return {
        **{p: f"*{dt}" for p in ("h_ptr", "w_ptr", "b_ptr")},
        "t_ptr": "*i64",
        **{p: "*fp32" for p in ("m_ptr", "s_ptr", "u_ptr", "tz_ptr")},
        "N": "i32",
        **{p: "i32!" for p in ("V", "H", "stride_hn", "stride_wv")},
        "inv_t": "fp32",
        "vocab_start": "i32!",
        "v_per_split": "i32!",
    }


def _lp_bwd_types(dt: str) -> dict[str, str]:
    return {
        **{p: f"*{dt}" for p in ("h_ptr", "w_ptr", "b_ptr")},
        "t_ptr": "*i64",
        **{p: "*fp32" for p in ("lse_ptr", "ent_ptr", "glp_ptr", "gent_ptr", "dh_ptr", "dw_ptr", "db_ptr")},
        "N": "i32",
        **{p: "i32!" for p in ("V", "H", "stride_hn", "stride_wv")},
        "inv_t": "fp32",
        "vocab_start": "i32!",
    }


def _sibling_types(dt: str) -> dict[str, str]:
    return {
        "t_ptr": f"*{dt}",
        "s_ptr": f"*{dt}",
        "srcok_ptr": "*i8",
        "tgtok_ptr": "*i8",
        "roll_ptr": "*i32",
        "h_ptr": "*fp32",
        "e_ptr": "*i8",
        "p_ptr": "*fp32",
        "valid_ptr": "*i8",
        "N": "i32",
        "D": "i32!",
        "inv_temp": "fp32",
        "gamma": "fp32",
    }


def _profiles_types(dt: str) -> dict[str, str]:
    return {
        "h_ptr": "*fp32",
        "e_ptr": "*i8",
        "p_ptr": "*fp32",
        "valid_ptr": "*i8",
        "N": "i32",
        "inv_temp": "fp32",
        "gamma": "fp32",
    }


def _pair_types(dt: str) -> dict[str, str]:
    return {
        "p_ptr": "*fp32",
        "e_ptr": "*i8",
        "rowp_ptr": "*i64",
        "rowq_ptr": "*i64",
        "out_ptr": "*fp32",
        "K": "i32",
        "N": "i32",
    }


@dataclass(frozen=True)
class KernelSpec:
    name: str  # the kernel function's name (= its key in tuning.CONFIGS)
    module: str  # where it lives
    types: Callable[[str], dict[str, str]]  # operand dtype -> argument types
    flags: Callable[[str], dict[str, object]]  # operand dtype -> constexpr flags of the CUDA launch
    dtypes: tuple[str, ...] = DTYPES  # operand dtypes the engine passes (fp32 only: the kernel upcasts before)
    alternatives: list[KernelConfig] = field(default_factory=list)  # shown in the table, not used by the engine
    unaligned: tuple[str, ...] = ()  # dtypes also compiled with sizes not divisible by 16 (comparison rows)

    def function(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.name)


def _old(num_warps: int, num_stages: int, **meta: int) -> KernelConfig:
    return KernelConfig(meta, num_warps, num_stages)


SPECS = [
    KernelSpec(
        "_lp_fwd_kernel",
        "alignopsd.kernels.head.logprob_triton",
        _lp_fwd_types,
        lambda dt: {"HAS_BIAS": False, "UPCAST": False, "DOT_PREC": _prec(dt)},
        alternatives=[
            _old(4, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),  # the former single configuration
            _old(8, 3, BLOCK_N=64, BLOCK_V=256, BLOCK_H=64),
        ],
        unaligned=("bf16",),
    ),
    KernelSpec(
        "_lp_bwd_kernel",
        "alignopsd.kernels.head.logprob_triton",
        _lp_bwd_types,
        lambda dt: {
            "HAS_BIAS": False,
            "HAS_GENT": True,
            "NEED_H": True,
            "NEED_W": True,
            "NEED_B": False,
            "UPCAST": False,
            "DOT_PREC": _prec(dt),
        },
        alternatives=[
            _old(4, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),  # the former single configuration
            _old(8, 3, BLOCK_N=64, BLOCK_V=256, BLOCK_H=32),
        ],
        unaligned=("bf16",),
    ),
    KernelSpec(
        "_sibling_kernel",
        "alignopsd.kernels.sibling_topk_triton",
        _sibling_types,
        lambda dt: {"UPCAST": False, "DOT_PREC": _prec(dt)},
    ),
    KernelSpec(
        "_profiles_kernel", "alignopsd.kernels.sibling_topk_triton", _profiles_types, lambda dt: {}, dtypes=("fp32",)
    ),
    KernelSpec("_pair_kernel", "alignopsd.kernels.jsd_boundary", _pair_types, lambda dt: {}, dtypes=("fp32",)),
]
