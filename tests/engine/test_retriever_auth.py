"""The retrieval server's bearer token (engine/envs/search/retriever_auth.py): real requests on loopback addresses
(127.0.0.1 and ::1) only; the refusal to serve beyond loopback without a token is checked before anything binds."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from alignopsd.engine.commands.serve_retriever import main as serve_main
from alignopsd.engine.envs.search import retrieval_server
from alignopsd.engine.envs.search.corpus_index import CorpusRetriever
from alignopsd.engine.envs.search.env import SearchEnv
from alignopsd.engine.envs.search.retrieval_server import RetrievalServer
from alignopsd.engine.envs.search.retriever import RetrieverClient, RetrieverError, start_retriever_process
from alignopsd.engine.envs.search.retriever_auth import (
    TOKEN_ENV_VAR,
    BearerAuth,
    check_exposure,
    is_loopback,
    read_token_file,
    resolve_token,
)

TOKEN = "s3cret-token-0123456789abcdef"
DOCS = [{"id": "d0", "contents": '"Osmira"\nOsmira is a city in Velland.'}, {"id": "d1", "contents": '"Tavrin"\nx'}]


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(TOKEN_ENV_VAR, raising=False)
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    return path


def _call(url: str, path: str, auth: str | None, body: dict | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth is not None else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


QUERY = {"queries": ["Osmira city"], "topk": 1}


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_token_server_answers_only_the_right_bearer(corpus, host):
    try:
        srv = RetrievalServer(CorpusRetriever.from_path(corpus), host=host, token=TOKEN).start()
    except OSError as exc:  # a machine without IPv6 loopback
        pytest.skip(f"cannot bind {host}: {exc}")
    with srv:
        for auth in (None, "", "Bearer", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN):
            for path, body in (("/retrieve", QUERY), ("/health", None), ("/nope", None)):
                code, out, headers = _call(srv.url, path, auth, body)
                assert code == 401 and "unauthorized" in out["error"], (auth, path, code)
                assert headers.get("www-authenticate", headers.get("WWW-Authenticate", "")).startswith("Bearer")
        code, out, _ = _call(srv.url, "/retrieve", f"Bearer {TOKEN}", QUERY)
        assert code == 200 and out["result"][0][0]["id"] == "d0"
        assert _call(srv.url, "/health", f"bearer  {TOKEN}", None)[0] == 200  # scheme case-insensitive
        assert RetrieverClient(srv.url, token=TOKEN).retrieve(["Osmira"], 1)[0][0].id == "d0"
        with pytest.raises(RetrieverError, match="401 unauthorized \\(sent no token\\)"):
            RetrieverClient(srv.url, retries=3).retrieve(["Osmira"], 1)
        with pytest.raises(RetrieverError, match="token that it refused"):
            RetrieverClient(srv.url, token="w" * 20).retrieve(["Osmira"], 1)


def test_client_and_search_env_send_the_token_of_the_same_setting(corpus, tmp_path, monkeypatch):
    with RetrievalServer(CorpusRetriever.from_path(corpus), token=TOKEN) as srv:
        monkeypatch.setenv(TOKEN_ENV_VAR, TOKEN)
        assert RetrieverClient(srv.url).retrieve(["Osmira"], 1)[0][0].id == "d0"  # from the environment
        assert SearchEnv(retriever_url=srv.url).token == TOKEN
        monkeypatch.delenv(TOKEN_ENV_VAR)
        f = tmp_path / "token"
        f.write_text(TOKEN + "\n")
        env = SearchEnv(retriever_url=srv.url, retriever_token_file=str(f))  # env.options.retriever_token_file
        assert env.token == TOKEN
        assert RetrieverClient(srv.url, token=env.token).retrieve(["Osmira"], 1)[0][0].id == "d0"
        assert SearchEnv(retriever_url=srv.url).token is None
    with pytest.raises(ValueError, match="token file .*missing"):
        SearchEnv(retriever_url="http://127.0.0.1:1", retriever_token_file=str(tmp_path / "missing"))


def test_token_sources_and_the_loopback_rule(tmp_path):
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
        check_exposure(host, None)
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "fe80::1", "example.org", ""):
        assert not is_loopback(host), host
        with pytest.raises(ValueError, match=f"--host {host} serves beyond loopback and needs a token"):
            check_exposure(host, None)
        check_exposure(host, TOKEN)
    f = tmp_path / "t"
    f.write_text(f"  {TOKEN}\n")
    assert read_token_file(f) == TOKEN and resolve_token(f, {}) == TOKEN
    assert resolve_token(None, {TOKEN_ENV_VAR: TOKEN}) == TOKEN
    assert resolve_token(None, {TOKEN_ENV_VAR: "  "}) is None and resolve_token(None, {}) is None
    with pytest.raises(ValueError, match=r"\$ALIGNOPSD_RETRIEVER_TOKEN: the token must be at least 16"):
        resolve_token(None, {TOKEN_ENV_VAR: "short"})
    f.write_text("two words here and more\n")
    with pytest.raises(ValueError, match="one word"):
        read_token_file(f)
    auth = BearerAuth(None, TOKEN)
    assert auth.authorized(f"Bearer {TOKEN}".encode()) and not auth.authorized(None)
    assert not auth.authorized(f"Bearer {TOKEN} extra".encode())


def test_beyond_loopback_without_token_is_refused_before_binding(corpus, monkeypatch, capsys, tmp_path):
    def no_bind(*a, **k):
        raise AssertionError("bound a socket")

    monkeypatch.setattr(retrieval_server, "_listening_socket", no_bind)
    monkeypatch.setattr(socket.socket, "bind", no_bind)
    with pytest.raises(ValueError, match="beyond loopback"):
        RetrievalServer(CorpusRetriever.from_path(corpus), host="0.0.0.0")
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        missing = tmp_path / "no-such-corpus.jsonl"  # refused before the corpus is even read
        assert serve_main(["--corpus", str(missing), "--host", host]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--host {host} serves beyond loopback and needs a token" in err
    short = tmp_path / "short"
    short.write_text("abc")
    assert serve_main(["--corpus", str(corpus), "--host", "0.0.0.0", "--token-file", str(short)]) == 2
    assert "at least 16 characters" in capsys.readouterr().err


@pytest.mark.slow
def test_child_server_inherits_the_token_of_the_run(corpus, monkeypatch):
    """``alignopsd serve-retriever`` as the engine starts it (a child process on loopback): with the run's
    $ALIGNOPSD_RETRIEVER_TOKEN it requires that token, and the run's clients send it."""
    monkeypatch.setenv(TOKEN_ENV_VAR, TOKEN)
    url, proc = start_retriever_process(corpus)
    try:
        assert url.startswith("http://127.0.0.1:")
        assert _call(url, "/retrieve", None, QUERY)[0] == 401
        assert RetrieverClient(url).retrieve(["Osmira"], 1)[0][0].id == "d0"
        assert "ALIGNOPSD_RETRIEVER_TOKEN" not in " ".join(proc.args) and TOKEN not in " ".join(proc.args)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
