"""Client side of the Search-R1 retrieval protocol, and starting one shared server per run.

Protocol and server: retrieval_server.py (FastAPI on uvicorn); corpus and BM25 index: corpus_index.py.

- ``RetrieverClient``: the client, with a timeout and retries; it sends the bearer token of
  ``$ALIGNOPSD_RETRIEVER_TOKEN`` (or the one it is given: ``env.options.retriever_token_file``), see retriever_auth.py,
  to the server's own origin only: a redirect to another scheme, host or port is refused, never followed (urllib
  would follow a 302 or 303 with the token). An ``https://`` server's certificate is verified against the system's
  authorities, or those of ``ca_file`` (``env.options.retriever_ca_file``).
- ``format_passages``: the Search-R1 rendering of retrieved documents.
- ``start_retriever_process``: our server in a child process on a free loopback port.
- ``ensure_retriever``: returns a URL: the configured one, else one already started for this process tree
  (environment variable ``ALIGNOPSD_RETRIEVER_URL``), else starts our server in a child process on a free
  loopback port and exports the variable, so worker processes created afterwards share that one server. That
  server inherits ``$ALIGNOPSD_RETRIEVER_TOKEN`` when set (and requires it); without it, it runs without a token.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import select
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.search.corpus_index import Document
from alignopsd.engine.envs.search.data import default_corpus_path
from alignopsd.engine.envs.search.retriever_auth import TOKEN_ENV_VAR, resolve_token
from alignopsd.engine.infra.cache import cache_root

__all__ = [
    "URL_ENV_VAR",
    "RetrieverClient",
    "RetrieverError",
    "ensure_retriever",
    "format_passages",
    "same_origin_opener",
    "start_retriever_process",
]

URL_ENV_VAR = "ALIGNOPSD_RETRIEVER_URL"


# -------------------------------------------------------------------------------------------------- client


class RetrieverError(RuntimeError):
    """The retrieval server could not be reached or answered badly after all retries."""


class RetrieverClient:
    """Client of a Search-R1 ``/retrieve`` endpoint with a per-request timeout and retries. ``token``: the bearer
    token to send (default: ``$ALIGNOPSD_RETRIEVER_TOKEN`` when set, else none), to this origin only. ``ca_file``:
    the certificate authorities an ``https://`` server's certificate is verified against (default: the system's)."""

    def __init__(
        self,
        url: str,
        timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.25,
        token: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
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
        self._headers = _auth_headers(token)
        self._opener = same_origin_opener(ca_file)

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Document]]:
        """Top-``topk`` documents per query (scores dropped)."""
        return [[d for d, _ in row] for row in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: Sequence[str], topk: int = 3) -> list[list[tuple[Document, float | None]]]:
        body = json.dumps({"queries": list(queries), "topk": int(topk), "return_scores": True}).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            headers = {"Content-Type": "application/json", **self._headers}
            req = urllib.request.Request(self.endpoint, data=body, headers=headers)
            wait = self.backoff * (2**attempt)
            try:
                with self._opener.open(req, timeout=self.timeout) as resp:
                    payload = json.loads(resp.read().decode("utf-8"))
                return _parse_result(payload, len(queries))
            except urllib.error.HTTPError as exc:
                last = exc
                if exc.code == 401:
                    sent = "a token that it refused" if self._headers else "no token"
                    raise RetrieverError(
                        f"retrieval at {self.endpoint}: 401 unauthorized (sent {sent}); give the server's token in "
                        f"${TOKEN_ENV_VAR} or env.options.retriever_token_file"
                    ) from None
                if 400 <= exc.code < 500:  # our request is wrong: retrying will not help
                    break
                wait = max(wait, _retry_after(exc.headers.get("Retry-After")))  # a busy server says when
            except (urllib.error.URLError, OSError, ValueError, TimeoutError) as exc:
                last = exc
            if attempt < self.retries:
                time.sleep(wait)
        raise RetrieverError(f"retrieval at {self.endpoint} failed after {self.retries + 1} attempt(s): {last}")


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects within the request's own origin (scheme, host, port); a redirect to another origin raises
    RetrieverError instead of being followed (urllib copies the request's headers, the token's included)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if _origin(newurl) != _origin(req.full_url):
            fp.close()
            raise RetrieverError(
                f"retrieval at {req.full_url}: the server redirected ({code}) to {newurl}, another origin; not "
                "followed, so the token is never sent there: give the retriever's final address instead"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def same_origin_opener(ca_file: str | os.PathLike[str] | None = None) -> urllib.request.OpenerDirector:
    """A urllib opener that follows redirects within the request's origin only and verifies an ``https://``
    server's certificate (against ``ca_file`` when given, else the system's authorities); ValueError naming an
    unreadable ``ca_file``."""
    try:
        context = ssl.create_default_context(cafile=None if ca_file is None else os.fspath(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"CA file {ca_file}: cannot be read as certificates ({exc})") from None
    return urllib.request.build_opener(_SameOriginRedirects(), urllib.request.HTTPSHandler(context=context))


def _auth_headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else resolve_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _retry_after(value: str | None) -> float:
    """Seconds of a ``Retry-After`` header given in seconds (0 when absent or a date), at most 60."""
    try:
        return min(60.0, max(0.0, float(value))) if value else 0.0
    except ValueError:
        return 0.0


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
        "alignopsd.engine",
        "serve-retriever",
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
        req = urllib.request.Request(url.rstrip("/") + "/health", headers=_auth_headers(None))
        with same_origin_opener().open(req, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError, RetrieverError):
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
