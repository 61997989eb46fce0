"""Retrieval: bm25s index cache, the Search-R1 HTTP protocol on loopback (server and client), ensure_retriever."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request

import pytest
from alignopsd.engine.envs.search.corpus_index import Bm25Index, CorpusRetriever, Document, load_corpus
from alignopsd.engine.envs.search.retrieval_server import RetrievalServer, ServerLimits
from alignopsd.engine.envs.search.retriever import (
    RetrieverClient,
    RetrieverError,
    ensure_retriever,
    format_passages,
    start_retriever_process,
)

DOCS = [
    {
        "id": "d0",
        "contents": '"Osmira"\nOsmira is a city in Velland, founded in 1204. The Drau River flows through.',
    },
    {"id": "d1", "contents": '"Ardel Quenby"\nArdel Quenby (born 1950) is a violinist born in Osmira.'},
    {"id": "d2", "contents": '"Tavrin Optics"\nTavrin Optics is a company founded in 1961 by Ardel Quenby.'},
    {"id": "d3", "title": "Morel Foods", "text": "Morel Foods is a packaged food company from Port Velland."},
]


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ALIGNOPSD_RETRIEVER_URL", "")  # recorded, so the URL ensure_retriever exports is undone
    monkeypatch.delenv("ALIGNOPSD_RETRIEVER_URL")
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    return path


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_answers_search_r1_protocol_on_loopback(corpus):
    with RetrievalServer(CorpusRetriever.from_path(corpus)) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        code, out = _post(srv.url + "/retrieve", {"queries": ["Ardel Quenby violinist", "Morel Foods"], "topk": 2,
                                                  "return_scores": True})  # fmt: skip
        assert code == 200 and len(out["result"]) == 2
        first = out["result"][0]
        assert first[0]["document"] == {"id": "d1", "contents": DOCS[1]["contents"]}
        assert len(first) <= 2 and first[0]["score"] >= first[-1]["score"] > 0
        assert out["result"][1][0]["document"]["contents"] == '"Morel Foods"\n' + DOCS[3]["text"]
        code, out = _post(srv.url + "/retrieve", {"queries": ["Osmira"], "topk": 1, "return_scores": False})
        assert code == 200 and out["result"][0] == [{"id": "d0", "contents": DOCS[0]["contents"]}]
        assert _post(srv.url + "/retrieve", {"queries": "Osmira", "topk": 0})[0] == 400
        assert _post(srv.url + "/retrieve", {"queries": [1, 2]})[0] == 400
        assert _post(srv.url + "/nope", {})[0] == 404
        with urllib.request.urlopen(srv.url + "/health", timeout=5) as resp:
            assert json.loads(resp.read()) == {"status": "ok", "documents": 4}
        client = RetrieverClient(srv.url, timeout=5)
        docs = client.retrieve(["Tavrin Optics founder", "zzzz unknown"], topk=3)
        assert docs[0][0] == Document("d2", DOCS[2]["contents"]) and docs[1] == []
        assert format_passages(docs[0][:1]) == "Doc 1(Title: Tavrin Optics) " + DOCS[2]["contents"].split("\n")[1]


def test_client_retries_then_fails_on_dead_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RetrieverClient(f"http://127.0.0.1:{port}", timeout=0.5, retries=1, backoff=0.0)
    with pytest.raises(RetrieverError, match="2 attempt"):
        client.retrieve(["x"])
    with pytest.raises(ValueError, match="url"):
        RetrieverClient("localhost:8000")


def test_index_cache_roundtrip_and_empty_queries(tmp_path):
    texts = [d.get("contents", d.get("text", "")) for d in DOCS]
    built = Bm25Index.cached("k1", lambda: texts, tmp_path)
    assert (tmp_path / "bm25s-v1-k1" / "n_docs.json").is_file()
    loaded = Bm25Index.cached("k1", lambda: pytest.fail("must load from the cache"), tmp_path)
    assert loaded.search("Osmira city river", 3) == built.search("Osmira city river", 3)
    assert loaded.search("the of and", 3) == [] and loaded.search("", 3) == []
    with pytest.raises(ValueError, match="k"):
        loaded.search("x", 0)
    with pytest.raises(ValueError, match="texts"):
        Bm25Index.build([])


def test_load_corpus_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "contents": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_corpus(bad)
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(tmp_path / "missing.jsonl")


@pytest.mark.slow
def test_ensure_retriever_starts_one_shared_server(corpus):
    assert ensure_retriever({"retriever_url": "http://example.invalid:1"}) == "http://example.invalid:1"
    url = ensure_retriever(corpus_path=corpus)
    assert os.environ["ALIGNOPSD_RETRIEVER_URL"] == url
    assert ensure_retriever(corpus_path=corpus) == url  # reused, not a second server
    assert ensure_retriever() == url  # no corpus named: the exported one
    docs = RetrieverClient(url).retrieve(["Osmira"], topk=1)
    assert docs[0][0].id == "d0"


# -- the server's limits: malformed requests, stalled clients, load ----------------------------------------


def _raw(url: str, data: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """Send raw bytes to the server at ``url``; returns (status, JSON body). Fails on no answer in time."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"connection closed without an answer to {data[:80]!r}"
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(body) < length:
            chunk = s.recv(65536)
            assert chunk, "connection closed in the middle of the answer"
            body += chunk
    return int(head.split()[1]), json.loads(body)


def _request(body: bytes, *, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    head = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % n + body


BAD_BODIES = [
    (b"[1, 2]", "JSON object"),
    (b'"Osmira"', "JSON object"),
    (b"null", "JSON object"),
    (b"not json", "not JSON"),
    (b"\xff\xfe", "UTF-8"),
    (b'{"queries": ["Osmira"], "topk": 1e400}', "topk"),
    (b'{"queries": ["Osmira"], "topk": NaN}', "NaN"),
    (b'{"queries": ["Osmira"], "topk": 1000000000}', "topk"),
    (b'{"queries": ["Osmira"], "topk": true}', "topk"),
    (b'{"queries": ["Osmira"], "topk": 2.5}', "topk"),
    (b'{"queries": ["Osmira"], "return_scores": "no"}', "return_scores"),
    (b'{"queries": [1, 2]}', "queries"),
    (b'{"topk": 3}', "queries"),
    (json.dumps({"queries": ["x"] * 9}).encode(), "at most 8"),
]


def test_malformed_requests_get_a_4xx_json_answer(corpus):
    limits = ServerLimits(max_body_bytes=4096, max_queries=8, max_topk=50, request_timeout_s=1.0)
    with RetrievalServer(CorpusRetriever.from_path(corpus), limits=limits) as srv:
        for body, why in BAD_BODIES:
            code, out = _raw(srv.url, _request(body))
            assert code == 400 and why in out["error"], (body, code, out)
        code, out = _raw(srv.url, _request(b"{}", length=10**12))  # announced, never sent
        assert code == 413 and "limit" in out["error"]
        chunked = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked += b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
        code, out = _raw(srv.url, chunked)  # streamed past the limit
        assert code == 413
        code, out = _raw(srv.url, _request(b'{"queries": ', length=100))  # the rest never comes
        assert code == 408 and "not received" in out["error"]
        code, out = _raw(srv.url, b"GET /retrieve HTTP/1.1\r\nHost: x\r\n\r\n")
        assert code == 405 and "error" in out
        code, out = _raw(srv.url, _request(b'{"queries": "Osmira", "topk": 1.0, "return_scores": false}'))
        assert code == 200 and out["result"][0][0]["id"] == "d0"  # one string, an integral float: accepted


def test_stalled_clients_are_timed_out_and_do_not_block_others(corpus):
    limits = ServerLimits(request_timeout_s=1.0)
    with RetrievalServer(CorpusRetriever.from_path(corpus), limits=limits) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        stalled = []
        try:
            for i in range(200):  # half send nothing, half half a request line
                s = socket.create_connection((host, int(port)), timeout=15)
                if i % 2:
                    s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
                stalled.append(s)
            code, out = _post(srv.url + "/retrieve", {"queries": ["Osmira"], "topk": 1})
            assert code == 200 and out["result"][0][0]["id"] == "d0"
            # a keep-alive connection that stalls in its second request
            s = socket.create_connection((host, int(port)), timeout=15)
            stalled.append(s)
            body = b'{"queries": ["Osmira"], "topk": 1}'
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
            closed = sum(s.recv(1) == b"" for s in stalled)  # blocks until the server closes (or 15 s)
        finally:
            for s in stalled:
                s.close()
        assert closed == 201


@pytest.mark.slow
def test_server_process_completes_1000_requests_from_64_clients(corpus):
    """A server in a subprocess on a free loopback port; 64 client threads, 1,000 requests, all answered 200."""
    import http.client
    import threading
    import time

    url, proc = start_retriever_process(corpus)
    host, port = url.removeprefix("http://").split(":")
    codes: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    guard = time.monotonic() + 240.0  # overall guard: no client loops past it
    queries = ["Osmira city", "Ardel Quenby violinist", "Tavrin Optics founder", "Morel Foods company"]

    def client(n: int, k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        for j in range(n):
            if time.monotonic() > guard:
                break
            body = json.dumps({"queries": [queries[(k + j) % 4]], "topk": 2, "return_scores": j % 2 == 0})
            try:
                conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                out = json.loads(resp.read())
                ok = resp.status == 200 and len(out["result"]) == 1 and out["result"][0]
                with lock:
                    codes.append(resp.status if ok else -resp.status)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                with lock:
                    errors.append(repr(exc))
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.close()

    try:
        per = [1000 // 64 + (k < 1000 % 64) for k in range(64)]
        threads = [threading.Thread(target=client, args=(per[k], k), daemon=True) for k in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, guard + 35.0 - time.monotonic()))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert not errors, errors[:5]
    assert len(codes) == 1000 and set(codes) == {200}
