"""How the retriever's token travels (engine/envs/search/retriever.py, retrieval_server.py, retriever_auth.py): never to
another origin through a redirect, over HTTPS when the server is given a certificate (the client verifying it), and
only as one word of printable ASCII. Real servers on 127.0.0.1 only."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from alignopsd.engine.commands import train as train_cmd
from alignopsd.engine.commands.serve_retriever import main as serve_main
from alignopsd.engine.config.preflight import preflight
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.envs.search.corpus_index import CorpusRetriever
from alignopsd.engine.envs.search.retrieval_server import RetrievalServer, TlsFiles
from alignopsd.engine.envs.search.retriever import RetrieverClient, RetrieverError
from alignopsd.engine.envs.search.retriever_auth import TOKEN_ENV_VAR, resolve_token

TOKEN = "s3cret-token-0123456789abcdef"
DOCS = [{"id": "d0", "contents": '"Osmira"\nOsmira is a city in Velland.'}, {"id": "d1", "contents": '"Tavrin"\nx'}]
ANSWER = {"result": [[{"document": {"id": "d0", "contents": '"Osmira"\nOsmira.'}, "score": 1.0}]]}
TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(TOKEN_ENV_VAR, raising=False)
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    return path


class _Server:
    """A bare HTTP server on 127.0.0.1: every request's (method, path, Authorization) is kept; ``/retrieve``
    answers with ``redirect`` (status, Location) when set, any other path with :data:`ANSWER`."""

    def __init__(self, redirect: tuple[int, str] | None = None) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                outer.seen.append((self.command, self.path, self.headers.get("Authorization")))
                if self.path == "/retrieve" and outer.redirect is not None:
                    self.send_response(outer.redirect[0])
                    self.send_header("Location", outer.redirect[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps(ANSWER).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

            def log_message(self, *args) -> None:
                pass

        self.redirect = redirect
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("code", [301, 302, 303, 307])
def test_a_redirect_to_another_port_is_refused_and_the_token_stays_home(code):
    other = _Server()
    home = _Server(redirect=(code, other.url + "/retrieve"))
    try:
        if code in (302, 303):  # what urllib's own redirect handling does: the token goes to the other port
            req = urllib.request.Request(home.url + "/retrieve", data=b"{}", headers={"Authorization": "Bearer x"})
            urllib.request.urlopen(req, timeout=10).close()
            assert other.seen[-1][2] == "Bearer x"
            other.seen.clear()
            home.seen.clear()
        client = RetrieverClient(home.url, token=TOKEN, retries=2, backoff=0.0)
        with pytest.raises(RetrieverError, match=rf"redirected \({code}\) to {other.url}/retrieve, another origin"):
            client.retrieve(["Osmira"], 1)
        assert other.seen == []  # nothing reached the other origin
        assert home.seen == [("POST", "/retrieve", f"Bearer {TOKEN}")]  # refused at once: no retry
    finally:
        home.close()
        other.close()


def test_a_redirect_within_the_origin_is_followed_with_the_token():
    home = _Server()
    home.redirect = (302, home.url + "/v2/retrieve")
    try:
        assert RetrieverClient(home.url, token=TOKEN).retrieve(["Osmira"], 1)[0][0].id == "d0"
        assert [s[1:] for s in home.seen] == [("/retrieve", f"Bearer {TOKEN}"), ("/v2/retrieve", f"Bearer {TOKEN}")]
    finally:
        home.close()
    localhost = _Server()  # another host name for the same machine is another origin all the same
    home = _Server(redirect=(302, localhost.url.replace("127.0.0.1", "localhost") + "/retrieve"))
    try:
        with pytest.raises(RetrieverError, match="another origin"):
            RetrieverClient(home.url, token=TOKEN, retries=0).retrieve(["Osmira"], 1)
        assert localhost.seen == []
    finally:
        home.close()
        localhost.close()


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (subjectAltName IP) and its key, made now: with the cryptography package, else
    the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is here to make a certificate")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key


def test_https_server_and_a_client_that_verifies_it(corpus, tmp_path):
    cert, key = _self_signed(tmp_path)
    retriever = CorpusRetriever.from_path(corpus)
    with RetrievalServer(retriever, token=TOKEN, tls=TlsFiles(str(cert), str(key))) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        assert RetrieverClient(srv.url, token=TOKEN, ca_file=cert).retrieve(["Osmira"], 1)[0][0].id == "d0"
        with pytest.raises(RetrieverError, match="CERTIFICATE_VERIFY_FAILED"):  # not a certificate it trusts
            RetrieverClient(srv.url, token=TOKEN, retries=0).retrieve(["Osmira"], 1)
        with pytest.raises(RetrieverError):  # plain HTTP to an HTTPS server gets no answer
            RetrieverClient(srv.url.replace("https", "http"), token=TOKEN, retries=0).retrieve(["Osmira"], 1)
    with pytest.raises(ValueError, match="CA file .*cannot be read"):
        RetrieverClient("https://127.0.0.1:1", ca_file=corpus)


def test_serve_retriever_serves_https_given_a_certificate_and_refuses_what_does_not_load(corpus, tmp_path, capsys):
    cert, key = _self_signed(tmp_path)
    for flags, said in (
        (["--ssl-certfile", str(cert)], "--ssl-certfile and --ssl-keyfile go together"),
        (["--ssl-certfile", str(corpus), "--ssl-keyfile", str(key)], "not a certificate and its key"),
    ):
        assert serve_main(["--corpus", str(tmp_path / "not-read.jsonl"), *flags]) == 2  # before the corpus is read
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    cmd = [sys.executable, "-m", "alignopsd.engine", "serve-retriever", "--corpus", str(corpus), "--port", "0",
           "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.match(r"RETRIEVER_URL (https://127\.0\.0\.1:\d+)$", line.strip())
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        assert RetrieverClient(url.group(1), ca_file=cert).retrieve(["Osmira"], 1)[0][0].id == "d0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("token", ["tökèn-0123456789abcdef", "token-0123456789\u00a0abcdef", "token 0123456789 abcdef"])
def test_a_token_that_cannot_be_a_header_is_refused_at_start_up(corpus, tmp_path, capsys, monkeypatch, token):
    with pytest.raises(ValueError, match="one word of printable ASCII characters"):
        resolve_token(None, {TOKEN_ENV_VAR: token})
    f = tmp_path / "token"
    f.write_text(token + "\n", encoding="utf-8")
    assert serve_main(["--corpus", str(corpus), "--token-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"token file {f}: the token must be one word of printable ASCII" in err
    search = ["env.name=search", "env.max_turns=4", f"env.options.retriever_token_file={f}"]
    with pytest.raises(ConfigError, match="env 'search': token file .* printable ASCII"):
        preflight(load_config(TINY, search), {})
    monkeypatch.setenv(TOKEN_ENV_VAR, token)  # the run's command: exit 2 and one line, before anything loads
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}", "--set", "env.name=search"]
    assert train_cmd.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config error: env 'search': $ALIGNOPSD_RETRIEVER_TOKEN: the token" in err
