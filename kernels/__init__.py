"""Kernels of the rescoring path: the LM head (``head/``: fused log-prob gathering and the fused head loss),
sibling top-K with profiles, adjacent JSD boundaries. Each has a Triton kernel (CUDA), a torch CPU path and a plain
torch reference; one rule routes every call (:func:`resolve_impl`): ``impl="auto"`` picks Triton on CUDA and the
CPU path elsewhere (a C++ one where it applies and was measured faster), ``impl="triton"|"torch"|"cpp"`` forces one
(Triton on CPU tensors needs ``TRITON_INTERPRET=1``). The algorithm core calls these kernels itself for CUDA inputs
(:func:`core_uses_kernels`). The routing
switches that tests and checks use (``force_kernels``, ``torch_paths_only``, ``launches_on_host``) are
exported by ``alignopsd.testing``, not here.
"""

from alignopsd.kernels._dispatch import (
    HAS_TRITON,
    NativePath,
    core_uses_kernels,
    interpret_mode,
    resolve_impl,
)
from alignopsd.kernels.head import (
    FusedTokenLoss,
    fused_token_loss,
    logprob,
    logprob_loss_and_grad,
    logprob_ref,
    logprob_rescore,
    logprob_vocab_parallel,
)
from alignopsd.kernels.jsd_boundary import (
    DISTANCES,
    batch_threshold,
    boundary_scores,
    boundary_scores_blocks,
    boundary_scores_rows,
)
from alignopsd.kernels.profiles import ProfileRows, profile_rows, profiles_blocks
from alignopsd.kernels.sibling_topk import (
    SiblingTopK,
    selection_lists,
    sibling_topk,
    sibling_topk_from_similarity,
)

__all__ = [
    "DISTANCES",
    "FusedTokenLoss",
    "HAS_TRITON",
    "NativePath",
    "ProfileRows",
    "SiblingTopK",
    "batch_threshold",
    "boundary_scores",
    "boundary_scores_blocks",
    "boundary_scores_rows",
    "fused_token_loss",
    "core_uses_kernels",
    "interpret_mode",
    "logprob",
    "logprob_loss_and_grad",
    "logprob_ref",
    "logprob_rescore",
    "logprob_vocab_parallel",
    "profile_rows",
    "profiles_blocks",
    "resolve_impl",
    "selection_lists",
    "sibling_topk",
    "sibling_topk_from_similarity",
]
