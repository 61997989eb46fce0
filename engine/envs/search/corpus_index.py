"""The retrieval corpus and its BM25 index (cached under ``engine/infra/cache.py``'s folder).

- ``Bm25Index``: bm25s over a list of texts, saved to / loaded from a cache folder (built once per key).
- ``Document`` / ``load_corpus``: a Search-R1 corpus jsonl (``{"id", "contents"}``, or ``{"id", "title", "text"}``).
- ``CorpusRetriever``: a corpus plus its index, answering Search-R1 result lists (the server's back end).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from alignopsd.engine.infra.cache import atomic_cached_dir, cache_root

__all__ = [
    "INDEX_VERSION",
    "Bm25Index",
    "CorpusRetriever",
    "Document",
    "load_corpus",
    "tokenize",
]

INDEX_VERSION = "bm25s-v1"


# --------------------------------------------------------------------------------------------------- index


def tokenize(texts: Sequence[str]) -> list[list[str]]:
    """Lower-cased word tokens (2+ word characters), English stopwords removed (bm25s tokenizer)."""
    import bm25s

    return bm25s.tokenize(list(texts), return_ids=False, show_progress=False, stopwords="en")


class Bm25Index:
    """A bm25s BM25 index over ``n_docs`` texts; results are document positions with a positive score."""

    def __init__(self, model: Any, n_docs: int) -> None:
        self._model = model
        self.n_docs = n_docs

    @classmethod
    def build(cls, texts: Sequence[str]) -> Bm25Index:
        import bm25s

        if len(texts) == 0:
            raise ValueError("texts: cannot index an empty corpus")
        model = bm25s.BM25()
        model.index(tokenize(texts), show_progress=False)
        return cls(model, len(texts))

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._model.save(str(folder), show_progress=False)
        (folder / "n_docs.json").write_text(json.dumps({"n_docs": self.n_docs, "version": INDEX_VERSION}))

    @classmethod
    def load(cls, folder: Path) -> Bm25Index:
        import bm25s

        folder = Path(folder)
        meta = json.loads((folder / "n_docs.json").read_text())
        model = bm25s.BM25.load(str(folder), show_progress=False)
        return cls(model, int(meta["n_docs"]))

    @classmethod
    def cached(cls, key: str, texts_fn: Callable[[], Sequence[str]], cache_dir: Path | None = None) -> Bm25Index:
        """Load the index saved under ``cache_dir/key``, building (and saving) it first when absent."""
        root = Path(cache_dir) if cache_dir is not None else cache_root() / "bm25"
        target = root / f"{INDEX_VERSION}-{key}"

        def _build(tmp: Path) -> None:
            cls.build(texts_fn()).save(tmp)

        try:
            atomic_cached_dir(target, _build)
            return cls.load(target)
        except (OSError, ValueError, KeyError):  # unwritable or corrupt cache: build in memory
            return cls.build(texts_fn())

    def search_batch(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        """Top-``k`` (position, score) per query, best first; documents with score 0 are left out."""
        if k <= 0:
            raise ValueError(f"k: must be positive, got {k}")
        k_eff = min(k, self.n_docs)
        toks = tokenize(queries)
        out: list[list[tuple[int, float]]] = [[] for _ in queries]
        live = [i for i, t in enumerate(toks) if t]
        if not live:
            return out
        docs, scores = self._model.retrieve([toks[i] for i in live], k=k_eff, show_progress=False, n_threads=1)
        for row, i in enumerate(live):
            pairs = [(int(d), float(s)) for d, s in zip(np.asarray(docs[row]), np.asarray(scores[row])) if s > 0]
            pairs.sort(key=lambda p: (-p[1], p[0]))  # deterministic order among ties
            out[i] = pairs
        return out

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        return self.search_batch([query], k)[0]


# -------------------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Document:
    id: str
    contents: str  # '"Title"\nText' (Search-R1 wiki layout) or plain text

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""

    def as_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


def load_corpus(path: str | os.PathLike[str]) -> list[Document]:
    """Read a corpus jsonl: ``{"id", "contents"}`` per line, or ``{"id", "title", "text"}``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"corpus_path: no such file: {p}")
    docs: list[Document] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"corpus_path: line {lineno} of {p} is not JSON ({exc})") from None
            if "contents" in row:
                contents = str(row["contents"])
            elif "text" in row:
                contents = f'"{row.get("title", "")}"\n{row["text"]}'
            else:
                raise ValueError(f"corpus_path: line {lineno} of {p} has neither 'contents' nor 'text'")
            docs.append(Document(str(row.get("id", len(docs))), contents))
    if not docs:
        raise ValueError(f"corpus_path: {p} holds no documents")
    return docs


def _file_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


class CorpusRetriever:
    """A corpus plus its (cached) BM25 index; answers Search-R1 result lists."""

    def __init__(self, docs: Sequence[Document], index: Bm25Index) -> None:
        self.docs = list(docs)
        self.index = index

    @classmethod
    def from_path(cls, corpus_path: str | os.PathLike[str], cache_dir: Path | None = None) -> CorpusRetriever:
        docs = load_corpus(corpus_path)
        key = "corpus-" + _file_key(Path(corpus_path))
        index = Bm25Index.cached(key, lambda: [d.contents for d in docs], cache_dir)
        if index.n_docs != len(docs):
            index = Bm25Index.build([d.contents for d in docs])
        return cls(docs, index)

    @functools.cached_property
    def max_doc_chars(self) -> int:
        """Characters of the longest document (id and contents): bounds the size of one answer entry."""
        return max(len(d.id) + len(d.contents) for d in self.docs)

    def result_item(self, position: int, score: float, return_scores: bool) -> dict[str, Any]:
        """One entry of a Search-R1 result list: the document, with its score when ``return_scores``."""
        doc = self.docs[position].as_json()
        return {"document": doc, "score": score} if return_scores else doc

    def retrieve(self, queries: Sequence[str], topk: int, return_scores: bool = True) -> list[list[dict[str, Any]]]:
        hits = self.index.search_batch(queries, topk)
        return [[self.result_item(i, s, return_scores) for i, s in row] for row in hits]
