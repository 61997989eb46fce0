"""The Search-R1 retrieval server: FastAPI on uvicorn (the stack of Search-R1's own retrieval server).

Protocol (the Search-R1 ``retrieval_server`` format, so the official servers and ours are interchangeable):

    POST /retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": "12", "contents": "\\"Title\\"\\nText"}, "score": 7.1}, ...], ...]}

With ``"return_scores": false`` (the default) each inner entry is the document dict itself, as Search-R1
answers; ``"queries"`` may also be one string. ``GET /health`` answers ``{"status": "ok", "documents": N}``.

Limits (:class:`ServerLimits`): every malformed request gets a 4xx JSON answer ``{"error": "..."}``
and never a dropped connection: a body that is not a JSON object, non-finite numbers, ``topk`` that is
not an integer in ``[1, max_topk]``, ``return_scores`` that is not a boolean, more than ``max_queries``
queries (400); a body over ``max_body_bytes``, announced or streamed (413); a body that stalls (408).
A connection that has not sent complete request headers within ``request_timeout_s`` of opening (or of
its previous response) is closed, so stalled clients hold neither a thread nor a slot; idle keep-alive
connections close after ``keep_alive_s``. The listen backlog is ``backlog`` (2048). Loopback (127.0.0.1)
is the default host.

Memory (:class:`ServerLimits`, defaults in brackets): a request asks for at most ``max_results`` (16,384)
documents in all (queries x topk, 400 beyond), and its answer may hold at most ``max_response_bytes``
(16 MiB, 400 "answer: over the limit" beyond: ask for fewer queries or a smaller topk). Each request is
admitted against two budgets of bytes in flight (engine/envs/search/memory_budget.py), first come, first served:
its body, before it is read (``body_budget_bytes``, 64 MiB; charged 16 x the announced length + 64 KiB, the
most its bytes, text and parsed strings take), and its work, before the search (``work_budget_bytes``; charged
twice the largest answer it can produce plus 256 bytes per result and a score array per query, see
:func:`work_charge`). A request that cannot be admitted within ``admission_wait_s`` (5 s) is answered 503 with
``Retry-After: retry_after_s`` (2); the charges are released when the answer has been sent. So the server holds
at most the two budgets beyond its corpus and index (measured: bench/results/retriever-memory-2026-12-02.md).

Access (engine/envs/search/retriever_auth.py): with a token every request must carry ``Authorization: Bearer
<token>`` (else 401, checked in constant time before the body is read); beyond loopback a token is required. Given a
certificate and its key (PEM files, :class:`TlsFiles`) the server speaks HTTPS only (its URL is ``https://``); the
files are loaded before the corpus is read, and files that do not load refuse the start (ValueError).

FastAPI and uvicorn are the ``serve`` extra; they are imported only when a server is built.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.search.corpus_index import CorpusRetriever
from alignopsd.engine.envs.search.memory_budget import MemoryBudget
from alignopsd.engine.envs.search.retrieval_requests import (
    AnswerTooLarge,
    ServerLimits,
    body_charge,
    parse_retrieve_request,
    render_result,
    work_budget,
    work_charge,
)
from alignopsd.engine.envs.search.retriever_auth import BearerAuth, check_exposure

__all__ = [
    "AnswerTooLarge",
    "RetrievalServer",
    "ServerLimits",
    "TlsFiles",
    "body_charge",
    "build_app",
    "parse_retrieve_request",
    "render_result",
    "serve_retriever",
    "work_budget",
    "work_charge",
]


def _announced_length(request: Any, limits: ServerLimits) -> int | None:
    """The body's Content-Length (None when chunked); raises ``_Reject`` (400 / 413)."""
    announced = request.headers.get("content-length")
    if announced is None:
        return None
    if not announced.isdigit():
        raise _Reject(400, f"Content-Length: not a byte count ({announced[:40]!r})")
    if int(announced) > limits.max_body_bytes:
        raise _Reject(413, f"body: {announced} bytes is over the limit of {limits.max_body_bytes}")
    return int(announced)


async def _read_body(request: Any, limits: ServerLimits) -> bytes:
    """The request body, bounded in size and time; raises ``_Reject`` (413 / 408 / 400)."""

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise _Reject(413, f"body: over the limit of {limits.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout=limits.request_timeout_s)
    except asyncio.TimeoutError:
        raise _Reject(408, f"body: not received within {limits.request_timeout_s:g}s") from None


def _release(held: list[tuple[MemoryBudget, int]]) -> None:
    while held:
        budget, charge = held.pop()
        budget.release(charge)


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def build_app(retriever: CorpusRetriever, limits: ServerLimits | None = None, token: str | None = None) -> Any:
    """The FastAPI application serving ``retriever`` over the Search-R1 protocol (with ``token``: to requests that
    present it as their bearer token only).

    The routes take the raw request (validated by :func:`parse_retrieve_request`), so they are added as
    plain routes rather than through FastAPI's parameter models.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    limits = limits or ServerLimits()
    bodies = MemoryBudget(limits.body_budget_bytes, "body_budget_bytes")
    work = MemoryBudget(work_budget(retriever, limits), "work_budget_bytes")
    app = FastAPI(title="alignopsd retrieval", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.budgets = (bodies, work)

    class Releasing(Response):
        """An answer that gives its charges back once sent (or once the client has gone)."""

        media_type = "application/json"

        def __init__(self, content: bytes, held: list[tuple[MemoryBudget, int]]) -> None:
            super().__init__(content)
            self.held = held

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                _release(self.held)

    def busy(what: str, close: bool) -> Any:
        headers = {"Retry-After": str(limits.retry_after_s), **({"Connection": "close"} if close else {})}
        message = f"busy: {what} not admitted within {limits.admission_wait_s:g}s; retry later"
        return JSONResponse({"error": message}, status_code=503, headers=headers)

    async def http_error(request: Any, exc: HTTPException) -> Any:  # 404, 405
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    async def health(request: Any) -> Any:
        return JSONResponse({"status": "ok", "documents": len(retriever.docs)})

    async def retrieve(request: Any) -> Any:
        held: list[tuple[MemoryBudget, int]] = []
        try:
            charge = body_charge(_announced_length(request, limits) or limits.max_body_bytes)
            if not await bodies.acquire(charge, limits.admission_wait_s):
                return busy("body", close=True)  # unread: the connection cannot be reused
            held.append((bodies, charge))
            queries, topk, return_scores = parse_retrieve_request(await _read_body(request, limits), limits)
            charge = work_charge(retriever, len(queries), topk, limits)
            if not await work.acquire(charge, limits.admission_wait_s):
                return busy("search", close=False)
            held.append((work, charge))
            args = (retriever, queries, topk, return_scores, limits.max_response_bytes)
            answer = Releasing(await run_in_threadpool(render_result, *args), held)
            held = []  # released by the answer once sent
            return answer
        except _Reject as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status, headers={"Connection": "close"})
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        finally:
            _release(held)

    app.add_exception_handler(HTTPException, http_error)
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/retrieve", retrieve, methods=["POST"])
    if token is not None:
        app.add_middleware(BearerAuth, token=token)
    return app


def _stall_guarded(base: type, timeout_s: float) -> type:
    """A uvicorn HTTP protocol class that closes a connection when no request is being served and the next
    one has not completed its headers ``timeout_s`` after the connection opened or the last response ended
    (uvicorn itself times out only idle keep-alive connections, not a client that stalls mid-request)."""

    class StallGuarded(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._stall_timer = self.loop.call_later(timeout_s, self._close_if_stalled)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._stall_timer.cancel()
            self._stall_timer = self.loop.call_later(timeout_s, self._close_if_stalled)

        def _close_if_stalled(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stall_timer.cancel()
            super().connection_lost(exc)

    return StallGuarded


def _protocol_class(timeout_s: float) -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return _stall_guarded(base, timeout_s)


def _listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate (chain) and private key, PEM files: the server speaks HTTPS with them."""

    certfile: str
    keyfile: str

    def check(self) -> None:
        """ValueError (one line, naming the files) when they do not load as a certificate and its key."""
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"--ssl-certfile {self.certfile} / --ssl-keyfile {self.keyfile}: not a certificate and its key ({exc})"
            ) from None


class RetrievalServer:
    """The server over a ``CorpusRetriever``, bound at construction (port 0: a free port); with ``token`` it
    answers only requests bearing it, and beyond loopback it refuses (ValueError, before binding) to run without.
    With ``tls`` it serves HTTPS.

    ``start()`` serves in a daemon thread (tests, in-process use); ``serve_forever()`` serves in the
    calling thread until ``close()`` or a signal.
    """

    def __init__(
        self,
        retriever: CorpusRetriever,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
        token: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        import uvicorn

        check_exposure(host, token)
        if tls is not None:
            tls.check()
        self.scheme = "http" if tls is None else "https"
        self.retriever = retriever
        self.limits = limits or ServerLimits()
        self.sock = _listening_socket(host, port, self.limits.backlog)
        self.app = build_app(retriever, self.limits, token)  # app.state.budgets: (body budget, work budget)
        config = uvicorn.Config(
            self.app,
            http=_protocol_class(self.limits.request_timeout_s),
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=self.limits.keep_alive_s,
            backlog=self.limits.backlog,
            ssl_certfile=None if tls is None else tls.certfile,
            ssl_keyfile=None if tls is None else tls.keyfile,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{self.scheme}://[{host}]:{port}" if ":" in host else f"{self.scheme}://{host}:{port}"

    def start(self, timeout: float = 30.0) -> RetrievalServer:
        self._thread = threading.Thread(target=self.serve_forever, name="retrieval-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("retrieval server did not start")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        self._server.run(sockets=[self.sock])

    def stop_soon(self) -> None:
        """Ask the serving loop to finish (it closes its connections and returns from ``serve_forever``)."""
        self._server.should_exit = True

    def close(self) -> None:
        self.stop_soon()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()

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
    limits: ServerLimits | None = None,
    token: str | None = None,
    tls: TlsFiles | None = None,
) -> None:
    """Serve ``corpus_path`` over the Search-R1 protocol until interrupted (or until ``parent_pid`` exits); beyond
    loopback only with a ``token``; HTTPS with ``tls`` (ValueError before the corpus loads)."""
    check_exposure(host, token)
    if tls is not None:
        tls.check()
    retriever = CorpusRetriever.from_path(corpus_path, Path(cache_dir) if cache_dir else None)
    server = RetrievalServer(retriever, host, port, limits, token, tls)
    if parent_pid is not None:

        def _watch() -> None:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(parent_pid, 0)
                except OSError:
                    break
            server.stop_soon()

        threading.Thread(target=_watch, daemon=True).start()
    (announce or (lambda u: print(f"RETRIEVER_URL {u}", flush=True)))(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.sock.close()
