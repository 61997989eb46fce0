"""``alignopsd serve-retriever --corpus FILE [--host H] [--token-file F] [--ssl-certfile C --ssl-keyfile K]``:
the Search-R1 retrieval server.

The server, its protocol and limits: engine/envs/search/retrieval_server.py. Its token (``--token-file`` or
``$ALIGNOPSD_RETRIEVER_TOKEN``, never a command-line value) and the loopback rule: engine/envs/search/retriever_auth.py.
With a certificate and its key it serves HTTPS. A host beyond loopback without a token, a token that cannot travel
as a header (not one word of printable ASCII), or a certificate and key that do not load end the command with exit
status 2 and one line, before anything loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from alignopsd.engine.envs.search.retrieval_server import ServerLimits, TlsFiles, serve_retriever
from alignopsd.engine.envs.search.retriever_auth import TOKEN_ENV_VAR, check_exposure, resolve_token

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    d = ServerLimits()
    ap = argparse.ArgumentParser(description="Search-R1 compatible BM25 retrieval server")
    ap.add_argument("--corpus", required=True, help="corpus jsonl with {id, contents} per line")
    ap.add_argument("--host", default="127.0.0.1", help="beyond loopback only with a token")
    ap.add_argument(
        "--token-file",
        default=None,
        help=f"file holding the bearer token every request must present (default: ${TOKEN_ENV_VAR} if set)",
    )
    ap.add_argument("--ssl-certfile", default=None, help="PEM certificate (chain): serve HTTPS (with --ssl-keyfile)")
    ap.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    ap.add_argument("--max-queries", type=int, default=d.max_queries)
    ap.add_argument("--max-topk", type=int, default=d.max_topk)
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="seconds")
    ap.add_argument("--max-results", type=int, default=d.max_results, help="queries x topk per request")
    ap.add_argument("--max-response-bytes", type=int, default=d.max_response_bytes)
    ap.add_argument("--body-budget-bytes", type=int, default=d.body_budget_bytes)
    ap.add_argument("--work-budget-bytes", type=int, default=d.work_budget_bytes, help="default: see ServerLimits")
    ap.add_argument("--admission-wait", type=float, default=d.admission_wait_s, help="seconds before a 503")
    args = ap.parse_args(argv)
    try:
        token = resolve_token(args.token_file)
        check_exposure(args.host, token)
        tls = _tls(args.ssl_certfile, args.ssl_keyfile)
    except ValueError as exc:
        print(f"serve-retriever: {exc}", file=sys.stderr)
        return 2
    try:
        limits = ServerLimits(
            max_body_bytes=args.max_body_bytes,
            max_queries=args.max_queries,
            max_topk=args.max_topk,
            request_timeout_s=args.request_timeout,
            max_results=args.max_results,
            max_response_bytes=args.max_response_bytes,
            body_budget_bytes=args.body_budget_bytes,
            work_budget_bytes=args.work_budget_bytes,
            admission_wait_s=args.admission_wait,
        )
    except ValueError as exc:
        ap.error(str(exc))
    try:
        serve_retriever(
            args.corpus,
            args.host,
            args.port,
            cache_dir=args.cache_dir,
            parent_pid=args.parent_pid,
            limits=limits,
            token=token,
            tls=tls,
        )
    except ValueError as exc:  # the corpus, or limits that do not fit it (work_budget)
        print(f"serve-retriever: {exc}", file=sys.stderr)
        return 2
    return 0


def _tls(certfile: str | None, keyfile: str | None) -> TlsFiles | None:
    """The certificate and key to serve HTTPS with (checked: they load), None for plain HTTP; ValueError when only
    one is given or they do not load."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both to serve HTTPS, or neither")
    tls = TlsFiles(certfile, keyfile)
    tls.check()
    return tls


if __name__ == "__main__":
    raise SystemExit(main())
