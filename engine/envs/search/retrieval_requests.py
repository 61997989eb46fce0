"""The retrieval server's request side, free of any web framework: the limits (:class:`ServerLimits`), what a
request is charged against the server's memory budgets (:func:`body_charge`, :func:`work_charge`,
:func:`work_budget`), the strict reading of a ``/retrieve`` body (:func:`parse_retrieve_request`) and the
size-bounded answer (:func:`render_result`). The protocol and the limits are described in
engine/envs/search/retrieval_server.py, which serves them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from alignopsd.engine.envs.search.corpus_index import CorpusRetriever

__all__ = [
    "AnswerTooLarge",
    "ServerLimits",
    "body_charge",
    "parse_retrieve_request",
    "render_result",
    "work_budget",
    "work_charge",
]


@dataclass(frozen=True)
class ServerLimits:
    """Bounds of the retrieval server (see the module docstring)."""

    max_body_bytes: int = 1 << 20
    max_queries: int = 1024
    max_topk: int = 1000
    request_timeout_s: float = 10.0
    keep_alive_s: int = 5
    backlog: int = 2048
    max_results: int = 16384
    max_response_bytes: int = 16 << 20
    body_budget_bytes: int = 64 << 20
    work_budget_bytes: int | None = None
    """None: 128 MiB, or twice the largest request's charge where the corpus makes that larger."""
    admission_wait_s: float = 5.0
    retry_after_s: int = 2

    def __post_init__(self) -> None:
        ints = ("max_body_bytes", "max_queries", "max_topk", "keep_alive_s", "backlog", "max_results")
        ints += ("max_response_bytes", "body_budget_bytes", "retry_after_s")
        for name in ints + (("work_budget_bytes",) if self.work_budget_bytes is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        for name in ("request_timeout_s", "admission_wait_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < math.inf):
                raise ValueError(f"{name}: expected a positive number of seconds, got {t!r}")
        if body_charge(self.max_body_bytes) > self.body_budget_bytes:
            raise ValueError(
                f"body_budget_bytes: {self.body_budget_bytes} is below the charge of the largest body "
                f"({body_charge(self.max_body_bytes)} for max_body_bytes={self.max_body_bytes})"
            )


def body_charge(nbytes: int) -> int:
    """Bytes a body of ``nbytes`` may hold while it is read and parsed: the bytes, the decoded text and the
    parsed strings (a string of two characters costs about 60 bytes for its five in the JSON)."""
    return 16 * nbytes + (64 << 10)


def work_charge(retriever: CorpusRetriever, n_queries: int, topk: int, limits: ServerLimits) -> int:
    """Bytes a search of ``n_queries`` x ``topk`` may hold until its answer is sent: the answer twice (its
    pieces, then joined), 256 bytes per result (hits, the index's arrays, the pieces' headers), a float32 and
    an int32 per document for the query being scored, and 64 KiB. An answer entry is at most 6 bytes per
    character of the longest document (JSON's ``\\u00XX`` escapes) plus its keys and score."""
    n_docs = len(retriever.docs)
    results = n_queries * min(topk, n_docs)
    answer = min(limits.max_response_bytes, results * (6 * retriever.max_doc_chars + 96) + 2 * n_queries + 16)
    return 2 * answer + 256 * results + 8 * n_docs + (64 << 10)


def work_budget(retriever: CorpusRetriever, limits: ServerLimits) -> int:
    """The work budget in bytes: ``limits.work_budget_bytes``, or by default 128 MiB or twice the largest
    request's charge, whichever is larger. ValueError when a set budget cannot admit the largest request."""
    largest = work_charge(retriever, limits.max_results, 1, limits)  # max_results queries of topk 1: the most
    if limits.work_budget_bytes is None:
        return max(128 << 20, 2 * largest)
    if limits.work_budget_bytes < largest:
        raise ValueError(
            f"work_budget_bytes: {limits.work_budget_bytes} is below the charge of the largest request ({largest});"
            " raise it, or lower max_results or max_response_bytes"
        )
    return limits.work_budget_bytes


def _reject_constant(name: str) -> Any:
    raise ValueError(f"body: {name} is not allowed")


def parse_retrieve_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body; returns ``(queries, topk, return_scores)`` or raises ValueError."""
    try:
        req = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ValueError("body: not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"body: not JSON ({exc.msg})") from None
    if not isinstance(req, dict):
        raise ValueError(f"body: expected a JSON object, got {type(req).__name__}")
    queries = req.get("queries")
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("queries: must be a list of strings")
    if len(queries) > limits.max_queries:
        raise ValueError(f"queries: at most {limits.max_queries} per request, got {len(queries)}")
    topk = req.get("topk", 3)
    if isinstance(topk, float) and math.isfinite(topk) and topk.is_integer():
        topk = int(topk)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise ValueError(f"topk: expected an integer in [1, {limits.max_topk}], got {topk!r}")
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f"return_scores: expected true or false, got {return_scores!r}")
    if len(queries) * topk > limits.max_results:
        raise ValueError(
            f"queries x topk: {len(queries)} x {topk} = {len(queries) * topk} documents, over the limit of "
            f"{limits.max_results} per request; send fewer queries or a smaller topk"
        )
    return queries, topk, return_scores


class AnswerTooLarge(ValueError):
    """The answer of a request would exceed ``max_response_bytes``."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def render_result(
    retriever: CorpusRetriever, queries: list[str], topk: int, return_scores: bool, max_bytes: int
) -> bytes:
    """The ``{"result": [...]}`` answer as JSON bytes, entry by entry (CorpusRetriever.result_item), stopping
    with AnswerTooLarge as soon as it would pass ``max_bytes``."""
    hits = retriever.index.search_batch(queries, topk)
    parts, size = [b'{"result":['], 13  # counted with the closing "]}"
    for q, row in enumerate(hits):
        parts.append(b"[" if q == 0 else b",[")
        size += 3
        for j, (position, score) in enumerate(row):
            item = _dumps(retriever.result_item(position, score, return_scores))
            size += len(item) + 1
            if size > max_bytes:
                raise AnswerTooLarge(
                    f"answer: over the limit of {max_bytes} bytes at query {q + 1} of {len(queries)}; "
                    "send fewer queries or a smaller topk"
                )
            parts.append(b"," + item if j else item)
        parts.append(b"]")
    parts.append(b"]}")
    return b"".join(parts)
