"""BM25 retrieval for the text environments: a cached bm25s index, and the Search-R1 HTTP protocol.

Protocol (the Search-R1 ``retrieval_server`` format, so the official servers and ours are interchangeable):

    POST /retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": "12", "contents": "\\"Title\\"\\nText"}, "score": 7.1}, ...], ...]}

With ``"return_scores": false`` each inner entry is the document dict itself (as Search-R1 answers).
``GET /health`` answers ``{"status": "ok", "documents": N}`` (ours only; the client never needs it).

Pieces:
- ``Bm25Index``: bm25s over a list of texts, saved to / loaded from a cache folder (built once per key).
- ``load_corpus``: a Search-R1 corpus jsonl (``{"id", "contents"}``, or ``{"id", "title", "text"}``).
- ``RetrievalServer`` / ``serve_retriever``: our server (``http.server.ThreadingHTTPServer``).
- ``RetrieverClient``: the client, with a timeout and retries.
- ``ensure_retriever``: returns a URL: the configured one, else one already started for this process tree
  (environment variable ``ALIGNOPSD_RETRIEVER_URL``), else starts our server in a child process on a free
  loopback port and exports the variable, so worker processes created afterwards share that one server.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

URL_ENV_VAR = "ALIGNOPSD_RETRIEVER_URL"
INDEX_VERSION = "bm25s-v1"


def cache_root() -> Path:
    """User cache folder of the engine (``$ALIGNOPSD_CACHE``, else ``$XDG_CACHE_HOME/alignopsd``)."""
    env = os.environ.get("ALIGNOPSD_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "alignopsd"


def atomic_cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``; if it does not exist, ``build`` it in a temporary sibling and rename it into place.

    Several worker processes may race here; the loser discards its copy, so readers never see half a folder.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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

    def retrieve(self, queries: Sequence[str], topk: int, return_scores: bool = True) -> list[list[dict[str, Any]]]:
        hits = self.index.search_batch(queries, topk)
        result = []
        for row in hits:
            if return_scores:
                result.append([{"document": self.docs[i].as_json(), "score": s} for i, s in row])
            else:
                result.append([self.docs[i].as_json() for i, _ in row])
        return result


# -------------------------------------------------------------------------------------------------- server


def _make_handler(retriever: CorpusRetriever) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet server
            return

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": len(retriever.docs)})
            else:
                self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"unknown path {self.path}"})
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(n).decode("utf-8") or "{}")
                queries = req.get("queries")
                if isinstance(queries, str):
                    queries = [queries]
                if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                    raise ValueError("queries: must be a list of strings")
                topk = int(req.get("topk", 3))
                if topk <= 0:
                    raise ValueError("topk: must be positive")
                return_scores = bool(req.get("return_scores", False))
            except (ValueError, TypeError, json.JSONDecodeError) as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, {"result": retriever.retrieve(queries, topk, return_scores)})

    return Handler


class RetrievalServer:
    """Our Search-R1-compatible server over a ``CorpusRetriever``; ``start()`` runs it in a daemon thread."""

    def __init__(self, retriever: CorpusRetriever, host: str = "127.0.0.1", port: int = 0) -> None:
        self.retriever = retriever
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(retriever))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RetrievalServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="retrieval-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> RetrievalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_retriever(
    corpus_path: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    parent_pid: int | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve ``corpus_path`` over the Search-R1 protocol until interrupted (or until ``parent_pid`` exits)."""
    retriever = CorpusRetriever.from_path(corpus_path, Path(cache_dir) if cache_dir else None)
    server = RetrievalServer(retriever, host, port)
    if parent_pid is not None:

        def _watch() -> None:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(parent_pid, 0)
                except OSError:
                    break
            server.httpd.shutdown()

        threading.Thread(target=_watch, daemon=True).start()
    (announce or (lambda u: print(f"RETRIEVER_URL {u}", flush=True)))(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


# -------------------------------------------------------------------------------------------------- client


class RetrieverError(RuntimeError):
    """The retrieval server could not be reached or answered badly after all retries."""


class RetrieverClient:
    """Client of a Search-R1 ``/retrieve`` endpoint with a per-request timeout and retries."""

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 3, backoff: float = 0.25) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected an http(s) URL, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout: must be positive, got {timeout}")
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/retrieve") else base + "/retrieve"
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Document]]:
        """Top-``topk`` documents per query (scores dropped)."""
        return [[d for d, _ in row] for row in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: Sequence[str], topk: int = 3) -> list[list[tuple[Document, float | None]]]:
        body = json.dumps({"queries": list(queries), "topk": int(topk), "return_scores": True}).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.endpoint, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    payload = json.loads(resp.read().decode("utf-8"))
                return _parse_result(payload, len(queries))
            except urllib.error.HTTPError as exc:
                last = exc
                if 400 <= exc.code < 500:  # our request is wrong: retrying will not help
                    break
            except (urllib.error.URLError, OSError, ValueError, TimeoutError) as exc:
                last = exc
            if attempt < self.retries:
                time.sleep(self.backoff * (2**attempt))
        raise RetrieverError(f"retrieval at {self.endpoint} failed after {self.retries + 1} attempt(s): {last}")


def _parse_result(payload: Any, n_queries: int) -> list[list[tuple[Document, float | None]]]:
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ValueError("retrieval response: expected {'result': [...]} ")
    rows = payload["result"]
    if len(rows) != n_queries:
        raise ValueError(f"retrieval response: {len(rows)} result lists for {n_queries} queries")
    out = []
    for row in rows:
        items = []
        for item in row:
            if isinstance(item, dict) and "document" in item:
                doc, score = item["document"], item.get("score")
            else:
                doc, score = item, None
            contents = doc.get("contents")
            if contents is None:  # some servers return title/text
                contents = f'"{doc.get("title", "")}"\n{doc.get("text", "")}'
            items.append((Document(str(doc.get("id", "")), str(contents)), None if score is None else float(score)))
        out.append(items)
    return out


def format_passages(docs: Sequence[Document]) -> str:
    """Search-R1 rendering: ``Doc i(Title: t) text`` per document, one per line."""
    lines = []
    for i, d in enumerate(docs, 1):
        lines.append(f"Doc {i}(Title: {d.title}) {d.text}".rstrip())
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ starting a shared one

_STARTED: dict[str, tuple[str, subprocess.Popen[str]]] = {}
_LOCK = threading.Lock()


def _cfg_get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def start_retriever_process(
    corpus_path: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 300.0,
    owner_pid: int | None = None,
) -> tuple[str, subprocess.Popen[str]]:
    """Start ``serve_retriever`` in a child process (port 0: a free port); returns (url, process).

    The child exits by itself when ``owner_pid`` (default: this process) exits; if the owner is this
    process it is also stopped at exit.
    """
    owner = os.getpid() if owner_pid is None else owner_pid
    cmd = [
        sys.executable,
        "-m",
        "alignopsd.engine.envs.retriever",
        "--corpus",
        str(corpus_path),
        "--host",
        host,
        "--port",
        str(port),
        "--parent-pid",
        str(owner),
    ]
    log_dir = cache_root() / "retrievers"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log", dir=log_dir, delete=False)
    # stderr goes to a file: a pipe nobody reads could fill up and stall the server
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    deadline = time.monotonic() + startup_timeout
    url = None
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(r"RETRIEVER_URL (\S+)", line.strip())
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        err = Path(log.name).read_text(errors="replace")
        raise RetrieverError(f"retrieval server for {corpus_path} did not start: {err[-2000:]}")
    if owner == os.getpid():
        atexit.register(_stop, proc)
    return url, proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _top_pid() -> int:
    """Pid of the run's main process: the parent of a multiprocessing worker, else this process."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid else os.getpid()


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def ensure_retriever(config: Any = None, *, corpus_path: str | os.PathLike[str] | None = None) -> str:
    """URL of a retrieval server, starting ours if none is configured.

    Order: ``config.retriever_url`` (dict key or attribute); ``$ALIGNOPSD_RETRIEVER_URL`` (when no corpus is
    named); the server this run already started for the corpus; else start one for ``corpus_path`` (or
    ``config.corpus_path``; default: the generated knowledge base of ``config.seed``).

    One server per corpus per run: the server is tied to the run's main process (it exits with it) and
    recorded in a small file in the cache folder, so environment workers that call this find and share it
    (under a file lock) instead of starting their own. The URL is also exported in
    ``$ALIGNOPSD_RETRIEVER_URL`` for processes started afterwards.
    """
    import fcntl

    url = _cfg_get(config, "retriever_url")
    if url:
        return str(url)
    if corpus_path is None:
        corpus_path = _cfg_get(config, "corpus_path")
    if corpus_path is None and os.environ.get(URL_ENV_VAR):
        return os.environ[URL_ENV_VAR]
    if corpus_path is None:
        from alignopsd.engine.envs.search_data import default_corpus_path

        corpus_path = default_corpus_path(seed=int(_cfg_get(config, "seed") or 0))
    corpus = Path(corpus_path)
    if not corpus.is_file():
        raise ValueError(f"corpus_path: no such file: {corpus}")
    top = _top_pid()
    key = hashlib.sha1(str(corpus.resolve()).encode()).hexdigest()[:16]
    reg = cache_root() / "retrievers"
    reg.mkdir(parents=True, exist_ok=True)
    record = reg / f"{key}.json"
    with _LOCK, open(reg / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            url = None
            if record.is_file():
                try:
                    rec = json.loads(record.read_text())
                    if rec.get("owner") == top and _healthy(rec["url"]):
                        url = rec["url"]
                except (ValueError, KeyError, OSError):
                    url = None
            if url is None:
                url, proc = start_retriever_process(corpus, owner_pid=top)
                _STARTED[key] = (url, proc)
                record.write_text(json.dumps({"url": url, "owner": top, "corpus": str(corpus.resolve())}))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    os.environ[URL_ENV_VAR] = url
    return url


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Search-R1 compatible BM25 retrieval server")
    ap.add_argument("--corpus", required=True, help="corpus jsonl with {id, contents} per line")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args(argv)
    serve_retriever(args.corpus, args.host, args.port, cache_dir=args.cache_dir, parent_pid=args.parent_pid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
