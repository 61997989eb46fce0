"""Retrieval server memory under its largest requests: the server's peak resident size (VmHWM) on loopback.

    python -m bench.retriever_memory --clients 3 --requests 2 --queries 16 --topk 1000
    python -m bench.retriever_memory --clients 16 --requests 2 --queries 1024 --topk 16 --probe 1024x1000

A synthetic corpus (``--docs`` documents of about 250 characters, every one containing the query words, so
every query fills its top-k) is written to a temporary folder; the server runs in a child process
(``alignopsd serve-retriever`` on a free loopback port); ``--clients`` threads each send
``--requests`` identical requests (``--queries`` queries, ``--topk``, scores returned) one after the other,
reading each answer to the end (the client keeps only its length). The server's VmRSS before the load
(after one small warm-up request) and its VmHWM after it are read from ``/proc/<pid>/status``.
``--probe QxK`` then sends one request of that shape alone (after the peak was read). Prints one JSON object:
statuses, answer bytes, latencies, RSS before and peak, the probe's status, bytes and time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

WORDS = "amber basalt cedar delta ember fjord garnet harbor island juniper kestrel lagoon meadow".split()


def write_corpus(path: Path, n_docs: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n_docs):
            tail = " ".join(rng.choice(WORDS) for _ in range(24))
            text = f"Place {i} is a city on the river with a market. {tail}."
            f.write(json.dumps({"id": str(i), "contents": f'"Place {i}"\n{text}'}) + "\n")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _client(host: str, port: int, body: str, n: int, timeout: float, record: list, lock: threading.Lock) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            size = 0
            while chunk := resp.read(1 << 20):
                size += len(chunk)
            row = (resp.status, size, time.perf_counter() - t0, resp.getheader("Retry-After"))
        except (OSError, http.client.HTTPException) as exc:
            row = (repr(exc)[:80], 0, time.perf_counter() - t0, None)
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        with lock:
            record.append(row)
    conn.close()


def _body(queries: int, topk: int) -> str:
    qs = [f"city river {WORDS[i % len(WORDS)]}" for i in range(queries)]
    return json.dumps({"queries": qs, "topk": topk, "return_scores": True})


def run(
    clients: int,
    requests: int,
    queries: int,
    topk: int,
    docs: int,
    timeout: float,
    probe: tuple[int, int] | None = None,
) -> dict:
    """The load, then (``probe``: queries, topk) one more request of that shape alone: its status and time."""
    from alignopsd.engine.envs.search.retriever import start_retriever_process

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ALIGNOPSD_CACHE"] = str(Path(tmp) / "cache")  # the index is built there, not in the user cache
        corpus = Path(tmp) / "corpus.jsonl"
        write_corpus(corpus, docs)
        url, proc = start_retriever_process(corpus)
        try:
            host, port = url.removeprefix("http://").split(":")
            warm: list = []
            small = json.dumps({"queries": ["city river"], "topk": 3})
            _client(host, int(port), small, 1, timeout, warm, threading.Lock())
            before = proc_status(proc.pid)
            body = _body(queries, topk)
            record: list = []
            lock = threading.Lock()
            threads = [
                threading.Thread(target=_client, args=(host, int(port), body, requests, timeout, record, lock))
                for _ in range(clients)
            ]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = proc_status(proc.pid)
            probed: list = []
            if probe is not None:
                _client(host, int(port), _body(*probe), 1, timeout, probed, lock)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    lat = sorted(r[2] for r in record if r[0] == 200)
    return {
        "clients": clients,
        "requests_per_client": requests,
        "queries": queries,
        "topk": topk,
        "docs": docs,
        "request_bytes": len(body),
        "warm_up_status": warm[0][0],
        "statuses": dict(Counter(str(r[0]) for r in record)),
        "retry_after": sorted({r[3] for r in record if r[3] is not None}),
        "answer_bytes_max": max((r[1] for r in record), default=0),
        "latency_s_200": [round(lat[0], 2), round(lat[len(lat) // 2], 2), round(lat[-1], 2)] if lat else [],
        "wall_s": round(wall, 1),
        "rss_before_mib": round(before["VmRSS"] / 2**20, 1),
        "hwm_before_mib": round(before["VmHWM"] / 2**20, 1),
        "hwm_after_mib": round(after["VmHWM"] / 2**20, 1),
        "rss_after_mib": round(after["VmRSS"] / 2**20, 1),
        "probe": {
            "shape": f"{probe[0]}x{probe[1]}",
            "status": probed[0][0],
            "bytes": probed[0][1],
            "s": round(probed[0][2], 2),
        }
        if probe
        else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--topk", type=int, default=1000)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--timeout", type=float, default=600.0, help="client socket timeout (s)")
    ap.add_argument("--probe", default=None, help="QxK: one request of Q queries, topk K after the load")
    a = ap.parse_args()
    probe = tuple(int(x) for x in a.probe.split("x")) if a.probe else None
    print(json.dumps(run(a.clients, a.requests, a.queries, a.topk, a.docs, a.timeout, probe)))


if __name__ == "__main__":
    main()
