"""The LM head: log-probabilities (and entropies) of given tokens from hidden states and the output embedding,
without the [N, V] logits, forward and backward, and the fused head loss; on CUDA through Triton, on the CPU
through torch tiles, a C++ kernel and a bf16 GEMM, each taken where it applies.

One concern per module:

- ``logprob.py``: the fused log-prob's design, its plain-torch reference, autograd wrapper and entries
  (:func:`logprob`, :func:`logprob_rescore`, :func:`logprob_vocab_parallel`); ``logprob_triton.py``: its Triton
  kernels (forward partials, backward) and their launchers;
- ``fused_loss.py``: log-probs, a per-token loss and its gradients in one sweep (:func:`logprob_loss_and_grad`,
  :func:`fused_token_loss`); ``fused_chunk.py``: the arithmetic of one chunk of it;
- ``partials.py``: the online-logsumexp partial statistics and their exact combination (splits, shards);
- ``checks.py``: the entries' input checks;
- the CPU paths: ``torch_tiles.py`` (forward partials and backward in fp32 tiles), ``cpu_partials.py`` (the C++ bf16
  forward), ``bf16_gemm.py`` (the GEMM on bf16 operands with fp32 results) and ``gemm_choice.py`` (when the tiles
  take it).
"""

from alignopsd.kernels.head.fused_loss import FusedTokenLoss, fused_token_loss, logprob_loss_and_grad
from alignopsd.kernels.head.logprob import logprob, logprob_ref, logprob_rescore, logprob_vocab_parallel

__all__ = [
    "FusedTokenLoss",
    "fused_token_loss",
    "logprob",
    "logprob_loss_and_grad",
    "logprob_ref",
    "logprob_rescore",
    "logprob_vocab_parallel",
]
