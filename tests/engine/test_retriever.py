"""Retrieval: bm25s index cache, the Search-R1 HTTP protocol on loopback (server and client), ensure_retriever."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request

import pytest
from alignopsd.engine.envs.retriever import (
    Bm25Index,
    CorpusRetriever,
    Document,
    RetrievalServer,
    RetrieverClient,
    RetrieverError,
    ensure_retriever,
    format_passages,
    load_corpus,
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
