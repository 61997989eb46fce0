"""The retrieval server's bearer token: where it comes from, who must present it, how it is checked.

One setting serves both ends: the environment variable :data:`TOKEN_ENV_VAR` (``ALIGNOPSD_RETRIEVER_TOKEN``), or
a file that holds the token (the server's ``--token-file``, the search environment's
``env.options.retriever_token_file``).
Never a command-line value: ``ps`` shows every process's arguments to every user of the machine.

- The server (``alignopsd serve-retriever``) with a token answers every request that lacks
  ``Authorization: Bearer <token>`` with 401 before reading its body; the comparison is constant-time
  (``hmac.compare_digest`` of the two SHA-256 digests, so neither content nor length leaks through timing).
- A server bound beyond loopback (any address but 127.0.0.0/8, ``::1`` and ``localhost``: ``0.0.0.0``, ``::``,
  a host name or a routable address) refuses to start without a token (:func:`check_exposure`).
- The client (``RetrieverClient``) sends the token of the same setting, to the server's origin only (a redirect to
  another scheme, host or port is refused). A token is one word of printable ASCII (it travels as an HTTP header);
  any other is refused where it is read, before a server starts or a run loads anything.
- Over plain HTTP the token crosses the network in clear text: beyond one host, serve HTTPS (``serve-retriever
  --ssl-certfile/--ssl-keyfile``, the client verifying the certificate, ``env.options.retriever_ca_file`` for a
  private authority) or keep to a trusted network.
- The server the engine starts for itself (``ensure_retriever``) binds to loopback; it inherits
  ``$ALIGNOPSD_RETRIEVER_TOKEN`` from the run when that is set (and then requires it, and the run's clients send it),
  and runs without a token otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MIN_TOKEN_CHARS",
    "TOKEN_ENV_VAR",
    "BearerAuth",
    "check_exposure",
    "is_loopback",
    "read_token_file",
    "resolve_token",
]

TOKEN_ENV_VAR = "ALIGNOPSD_RETRIEVER_TOKEN"
MIN_TOKEN_CHARS = 16


def _checked(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: the token must be at least {MIN_TOKEN_CHARS} characters (got {len(token)})")
    if not token.isascii() or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(
            f"{where}: the token must be one word of printable ASCII characters (it is sent as an HTTP header)"
        )
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace dropped); ValueError naming the file when it is missing,
    unreadable, short or not one printable word."""
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token file {path}: cannot be read ({exc})") from None
    return _checked(text, f"token file {path}")


def resolve_token(
    token_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The token of the setting: ``token_file`` when given, else ``$ALIGNOPSD_RETRIEVER_TOKEN`` when set and not
    empty, else None (no token)."""
    if token_file:
        return read_token_file(token_file)
    value = (os.environ if environ is None else environ).get(TOKEN_ENV_VAR, "")
    return _checked(value, f"${TOKEN_ENV_VAR}") if value.strip() else None


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` serves this machine only: ``localhost`` or an address in 127.0.0.0/8 or ``::1``.
    The wildcard addresses (``0.0.0.0``, ``::``), other addresses and other host names are not."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Refuse (ValueError, one line) to serve beyond loopback without a token."""
    if token is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} serves beyond loopback and needs a token: put one in a file (--token-file FILE) or in "
            f"${TOKEN_ENV_VAR}"
        )


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerAuth:
    """ASGI middleware: a request without ``Authorization: Bearer <token>`` gets 401 (JSON ``{"error": ...}``,
    ``WWW-Authenticate: Bearer``, connection closed since its body is not read) before the application sees it."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._digest = _digest(token.encode())

    def authorized(self, header: bytes | None) -> bool:
        scheme, _, presented = (header or b"").partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        same = hmac.compare_digest(_digest(presented.strip()), self._digest)  # always computed: constant time
        return ok_scheme and same

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), None)
        if self.authorized(header):
            return await self.app(scope, receive, send)
        body = b'{"error": "unauthorized: this server needs Authorization: Bearer <token>"}'
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="retrieval"'),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
