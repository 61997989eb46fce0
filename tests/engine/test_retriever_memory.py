"""The retrieval server's memory bounds: per-request limits, admission against a budget (queue, then 503)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from alignopsd.engine.envs.search.corpus_index import CorpusRetriever
from alignopsd.engine.envs.search.memory_budget import MemoryBudget
from alignopsd.engine.envs.search.retrieval_server import (
    RetrievalServer,
    ServerLimits,
    render_result,
    work_budget,
    work_charge,
)
from alignopsd.engine.envs.search.retriever import RetrieverClient

DOCS = [{"id": f"d{i}", "contents": f'"Place {i}"\nPlace {i} is a city on the river, number {i}.'} for i in range(12)]


@pytest.fixture()
def retriever(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    return CorpusRetriever.from_path(path)


def _post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + "/retrieve", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), {k.lower(): v for k, v in exc.headers.items()}


def test_budget_admits_in_arrival_order_and_times_out():
    async def scenario() -> None:
        b = MemoryBudget(100)
        assert await b.acquire(60, 1.0) and b.used == 60
        big = asyncio.create_task(b.acquire(60, 5.0))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(b.acquire(10, 5.0))  # would fit, but waits behind the earlier request
        await asyncio.sleep(0.01)
        assert b.waiting == 2 and not big.done() and not small.done()
        b.release(60)
        assert await big and await small and b.used == 70 and b.peak == 70
        assert not await b.acquire(40, 0.05)  # does not fit in time: refused, nothing reserved
        assert b.used == 70 and b.waiting == 0
        gone = asyncio.create_task(b.acquire(40, 5.0))
        await asyncio.sleep(0.01)
        gone.cancel()  # a client that went away leaves the queue
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert b.waiting == 0 and b.used == 70
        with pytest.raises(ValueError, match="exceeds the capacity"):
            await b.acquire(101, 1.0)

    asyncio.run(scenario())


def test_results_and_answer_size_limits(retriever):
    limits = ServerLimits(max_results=24, max_response_bytes=2000)
    with RetrievalServer(retriever, limits=limits) as srv:
        code, out, _ = _post(srv.url, {"queries": ["city river"] * 5, "topk": 5})
        assert code == 400 and "5 x 5 = 25 documents, over the limit of 24" in out["error"]
        code, out, _ = _post(srv.url, {"queries": ["city river"] * 4, "topk": 6, "return_scores": True})
        assert code == 400 and out["error"].startswith("answer: over the limit of 2000 bytes at query")
        req = urllib.request.Request(srv.url + "/retrieve", data=b'{"queries": ["city river"], "topk": 12}')
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
        assert 900 < len(raw) <= 2000 and len(json.loads(raw)["result"][0]) == 12
    # the server's rendering is the layout of CorpusRetriever.retrieve, entry for entry
    for scores in (True, False):
        rendered = json.loads(render_result(retriever, ["river 3", "nothing"], 4, scores, 1 << 20))
        assert rendered == {"result": retriever.retrieve(["river 3", "nothing"], 4, scores)}


def test_limits_that_cannot_admit_the_largest_request_are_refused(retriever):
    with pytest.raises(ValueError, match="body_budget_bytes"):
        ServerLimits(max_body_bytes=1 << 20, body_budget_bytes=1 << 20)
    tight = ServerLimits(max_results=1000, work_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="work_budget_bytes: 1048576 is below the charge of the largest request"):
        work_budget(retriever, tight)
    assert work_budget(retriever, ServerLimits()) == 128 << 20


def test_a_burst_over_the_budget_is_queued_then_refused_with_retry_after(retriever):
    """Two requests fit the work budget at once: a third waits until one finishes (served 200), or, when none
    finishes within admission_wait_s, is answered 503 with Retry-After; no more than two are ever searched."""
    probe = ServerLimits(max_results=12)
    charge = work_charge(retriever, 1, 12, probe)
    limits = ServerLimits(max_results=12, work_budget_bytes=2 * charge, admission_wait_s=1.0, retry_after_s=2)
    gate, lock, state = threading.Event(), threading.Lock(), {"inside": 0, "peak": 0}
    search = retriever.index.search_batch

    def gated(queries, k):  # the real search, held until the test opens the gate
        with lock:
            state["inside"] += 1
            state["peak"] = max(state["peak"], state["inside"])
        gate.wait(30)
        try:
            return search(queries, k)
        finally:
            with lock:
                state["inside"] -= 1

    retriever.index.search_batch = gated
    body = {"queries": ["city river"], "topk": 12}
    answers: list[tuple[int, dict, dict]] = []

    def client() -> None:
        answers.append(_post(srv.url, body))

    with RetrievalServer(retriever, limits=limits) as srv:
        try:
            bodies, work = srv.app.state.budgets
            first = [threading.Thread(target=client) for _ in range(2)]
            for t in first:
                t.start()
            _until(lambda: state["inside"] == 2)
            t0 = time.monotonic()
            refused = _post(srv.url, body)  # the budget is full for longer than admission_wait_s
            assert refused[0] == 503 and refused[2]["retry-after"] == "2" and "busy" in refused[1]["error"]
            assert 0.9 < time.monotonic() - t0 < 10 and state["inside"] == 2
            queued = threading.Thread(target=client)
            queued.start()
            _until(lambda: work.waiting == 1)  # queued, not searched
            assert state["inside"] == 2
            gate.set()
            for t in (*first, queued):
                t.join(30)
            assert [a[0] for a in answers] == [200, 200, 200] and all(len(a[1]["result"][0]) == 12 for a in answers)
            assert state["peak"] == 2 and work.peak == 2 * charge and work.used == 0 and bodies.used == 0
            # the client honours Retry-After: refused after 1 s, it retries 2 s later, when the budget has room
            gate.clear()
            first = [threading.Thread(target=client) for _ in range(2)]
            for t in first:
                t.start()
            _until(lambda: state["inside"] == 2)
            got: list = []
            t0 = time.monotonic()
            patient_client = RetrieverClient(srv.url, timeout=30, retries=1, backoff=0.0)
            patient = threading.Thread(target=lambda: got.append(patient_client.retrieve(["x y"])))
            patient.start()
            time.sleep(1.5)
            gate.set()
            for t in (*first, patient):
                t.join(30)
            assert got == [[[]]] and time.monotonic() - t0 > 2.9 and state["peak"] == 2
        finally:
            gate.set()  # no client left blocked when an assertion fails


def _until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.slow
def test_largest_requests_keep_the_server_process_within_its_budgets(monkeypatch, tmp_path):
    """A server process on a 20,000-document corpus, 3 clients sending the largest legal request at once:
    all answered (200, or 503 past the admission wait), the peak resident size (VmHWM) within the server's
    size before the load plus its two budgets (1024 x 1000, which took it to 2.6 GB before, is now a 400)."""
    from bench.retriever_memory import run

    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path))  # run() points it at its own folder; restored after
    d = ServerLimits()
    assert 16 * 1000 <= d.max_results
    out = run(clients=3, requests=1, queries=16, topk=1000, docs=20000, timeout=120.0, probe=(1024, 1000))
    assert set(out["statuses"]) <= {"200", "503"} and out["statuses"].get("200", 0) >= 1, out
    assert 4_000_000 < out["answer_bytes_max"] <= d.max_response_bytes
    budgets_mib = (d.body_budget_bytes + (128 << 20)) / 2**20
    assert out["hwm_after_mib"] < out["rss_before_mib"] + budgets_mib, out
    assert out["probe"]["status"] == 400 and out["probe"]["s"] < 5.0, out
