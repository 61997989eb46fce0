"""Search-QA: exact match, full episodes through a real loopback retrieval server, bad actions, data loading."""

from __future__ import annotations

import json

import pytest
from alignopsd.engine.envs.base import TaskSpec
from alignopsd.engine.envs.prompts import PromptContext
from alignopsd.engine.envs.search.corpus_index import CorpusRetriever
from alignopsd.engine.envs.search.data import (
    SOURCES,
    default_corpus_path,
    generate_kb,
    kb_questions,
    load_searchr1_parquet,
)
from alignopsd.engine.envs.search.env import (
    INVALID_OBSERVATION,
    SearchEnv,
    exact_match,
    load_tasks,
    normalize_answer,
    parse_search_action,
    search_prompt,
)
from alignopsd.engine.envs.search.retrieval_server import RetrievalServer


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("ALIGNOPSD_CACHE", str(tmp_path_factory.mktemp("cache")))
    mp.delenv("ALIGNOPSD_RETRIEVER_URL", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def server(cache):
    with RetrievalServer(CorpusRetriever.from_path(default_corpus_path(0))) as srv:
        yield srv


# ------------------------------------------------------------------------------------------ exact match


@pytest.mark.parametrize(
    ("pred", "golds", "hit"),
    [
        ("The Eiffel Tower!", ["eiffel tower"], True),
        ("  an   Apple. ", "apple", True),
        ("1875.", ["1875"], True),
        ("Port-Velland", ["PortVelland"], True),  # punctuation is deleted, not replaced by a space
        ("Paris, France", ["Paris"], False),
        ("the", ["a"], True),  # both normalise to ""
        ("Berlin", ["Bonn", "berlin "], True),
        ("theater", ["ater"], False),  # articles only as whole words
    ],
)
def test_exact_match_squad_normalisation(pred, golds, hit):
    assert exact_match(pred, golds) is hit


def test_normalize_answer():
    assert normalize_answer("The  Quick, Brown  Fox!") == "quick brown fox"


# ------------------------------------------------------------------------------------------------- KB


def test_kb_is_seeded_fictional_and_covers_all_sources(cache):
    p0, q0 = generate_kb(0)
    assert (p0, q0) == generate_kb(0)
    assert p0 != generate_kb(1)[0]
    assert {q["data_source"] for q in q0} == set(SOURCES)
    titles = {json.loads(json.dumps(p))["contents"].split("\n")[0].strip('"') for p in p0}
    for q in q0:  # every supporting passage exists
        assert set(q["support"]) <= titles, q
    assert len({q["question"] for q in q0}) == len(q0)
    train, test = load_tasks("train", None, 0), load_tasks("test", None, 0)
    assert {t.data_source for t in train} == {"nq", "hotpotqa"} and {t.data_source for t in test} == set(SOURCES)
    assert not {t.payload["question"] for t in train} & {t.payload["question"] for t in test}
    assert [t.key for t in load_tasks("test", 7, 3)] == [t.key for t in load_tasks("test", 7, 3)]
    assert all(t.category == t.data_source for t in test)


# ------------------------------------------------------------------------------------------- episodes


def _task(source: str, kind: str) -> TaskSpec:
    return next(t for t in load_tasks("test", None, 0) if t.data_source == source and t.payload["kind"] == kind)


def test_two_hop_episode_search_then_answer(server):
    task = _task("hotpotqa", "bridge")
    env = SearchEnv(retriever_url=server.url)
    obs, info = env.reset(task, 0)
    assert obs == task.payload["question"] and info["task"] == obs and info["admissible_actions"] == []
    first, second = task.payload["support"]
    r = env.step(f"<search>{first}</search>")
    assert r.observation.startswith("<information>Doc 1(Title: ") and r.observation.endswith("</information>")
    assert r.observation.startswith(f"<information>Doc 1(Title: {first})") and 1 <= r.observation.count("Doc ") <= 3
    assert not r.done and r.reward == 0.0 and r.info["search_query"] == first
    r = env.step(f"<search>{second}</search>")
    assert f"(Title: {second})" in r.observation
    gold = task.payload["golden_answers"][0]
    assert gold in r.observation  # the second passage holds the answer
    r = env.step(f"<answer> {gold.upper()}. </answer>")
    assert r.done and r.reward == 10.0 and r.info["won"] and r.info["task_score"] == 1.0


def test_wrong_answer_and_turn_limit(server):
    task = _task("nq", "single")
    env = SearchEnv(retriever_url=server.url)
    env.reset(task, 0)
    r = env.step("<answer>definitely not it</answer>")
    assert r.done and r.reward == 0.0 and not r.info["won"]
    env.reset(task, 0)
    for i in range(3):
        assert not env.step(f"<search>q{i}</search>").done
    r = env.step("<search>last</search>")
    assert r.done and r.reward == 0.0 and r.info["truncated"]
    with pytest.raises(RuntimeError):
        env.step("<answer>x</answer>")


@pytest.mark.parametrize(
    "action",
    ["", "go north", "<search></search>", "<answer>x", "<search>  </search>", "搜索 巴黎", "search[paris]", None],
)
def test_bad_actions_are_invalid_steps(server, action):
    env = SearchEnv(retriever_url=server.url)
    env.reset(_task("popqa", "single"), 0)
    r = env.step(action)
    assert r.observation == INVALID_OBSERVATION and not r.done and r.reward == 0.0
    assert r.info["action_admissible"] is False and env.steps == 1


def test_parse_search_action():
    assert parse_search_action("<search> who  is x </search>") == ("search", "who is x")
    assert parse_search_action("<ANSWER>Paris</ANSWER>") == ("answer", "Paris")
    assert parse_search_action("<search>a</answer>") == (None, "")


def test_local_retrieval_matches_http(server):
    task = _task("popqa", "single")
    a, b = SearchEnv(retriever_url="local"), SearchEnv(retriever_url=server.url)
    a.reset(task, 0)
    b.reset(task, 0)
    q = f"<search>{task.payload['support'][0]}</search>"
    assert a.step(q).observation == b.step(q).observation


def test_bad_payload_raises_value_error():
    env = SearchEnv(retriever_url="local")
    with pytest.raises(ValueError, match="question"):
        env.reset(TaskSpec("k", "search", "nq", "nq", payload={"golden_answers": ["x"]}), 0)
    with pytest.raises(ValueError, match="golden_answers"):
        env.reset(TaskSpec("k", "search", "nq", "nq", payload={"question": "q?"}), 0)


# --------------------------------------------------------------------------------------- prompts, manager


def test_prompt_shows_last_k_query_information_pairs():
    builder = search_prompt()
    first = builder.render(PromptContext(task="Who?", observation="Who?"))
    assert "Your question: Who?" in first and "<search> </search>" in first and "History" not in first
    hist = [("Who?", f"q{i}") for i in range(1)] + [(f"<information>r{i}</information>", f"q{i + 1}") for i in range(4)]
    text = builder.render(PromptContext("Who?", "<information>r4</information>", [], hist))
    assert "already taken 5 step(s)" in text
    assert "<search> q0 </search>" not in text  # only the last 4 pairs
    assert "Step 5:\n<search> q4 </search>\n<information>r4</information>" in text
    assert "Step 2:\n<search> q1 </search>\n<information>r1</information>" in text


def test_manager_search_episode(server):
    from alignopsd.engine.envs.manager import EnvManager

    task = _task("popqa", "single")
    gold = task.payload["golden_answers"][0]
    with EnvManager("search", num_workers=0, retriever_url=server.url) as mgr:
        prompts, _ = mgr.reset([task], group_n=3, seed=0)
        assert task.payload["question"] in prompts[0]
        resp = f"<think>look it up</think><search>{task.payload['support'][0]}</search>"
        obs, rewards, dones, infos = mgr.step([resp, "<answer>x</answer>", "<think>t</think><action>x</action>"])
        assert [i["is_action_valid"] for i in infos] == [True, False, False]
        assert infos[0]["observation"].startswith("<information>") and not any(dones)
        assert f"<search> {task.payload['support'][0]} </search>" in obs[0]
        obs, rewards, dones, infos = mgr.step([f"<think>found</think><answer>{gold}</answer>", "", ""])
        assert rewards[0] == 10.0 and dones[0] and infos[0]["won"]
        results = mgr.episode_results()
        assert [(r["data_source"], r["won"]) for r in results] == [("popqa", True), ("popqa", False), ("popqa", False)]


# ------------------------------------------------------------------------------------------ Search-R1 data


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_searchr1_parquet_layouts(tmp_path):
    prompt = "Answer the given question. ... Question: who wrote the lost harbor?\n"
    _write_parquet(
        tmp_path / "train.parquet",
        [
            {"data_source": "nq", "prompt": [{"role": "user", "content": prompt}], "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["Mira Olsen", "M. Olsen"]}},
             "extra_info": {"split": "train", "index": 7}},
        ],
    )  # fmt: skip
    _write_parquet(
        tmp_path / "test.parquet",
        [
            {"id": "b1", "data_source": "bamboogle", "question": "Who founded X?", "golden_answers": ["Ann Lee"]},
            {"id": "p2", "data_source": "popqa", "question": "What is Y?", "golden_answers": ["a cat", "cat"]},
        ],
    )
    rows = load_searchr1_parquet(tmp_path / "train.parquet")
    assert rows == [{"id": "nq-7", "question": "who wrote the lost harbor?", "golden_answers": ["Mira Olsen",
                     "M. Olsen"], "data_source": "nq"}]  # fmt: skip
    tasks = load_tasks("test", None, 0, data_dir=tmp_path)
    assert sorted(t.data_source for t in tasks) == ["bamboogle", "popqa"]
    assert all("kb_seed" not in t.payload for t in tasks)
    with pytest.raises(ValueError, match="retriever_url"):  # not our KB: a retriever must be configured
        env = SearchEnv()
        env.reset(tasks[0], 0)
        env.step("<search>x</search>")
    with pytest.raises(ValueError, match="parquet"):
        load_searchr1_parquet(tmp_path / "missing.parquet")
    # with its corpus jsonl ({"id", "contents"}) the episode runs on the given data
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Ann Lee"\nAnn Lee founded X in 1990.'}) + "\n")
    task = next(t for t in tasks if t.data_source == "bamboogle")
    env = SearchEnv(retriever_url="local", corpus_path=corpus)
    env.reset(task, 0)
    assert env.step("<search>who founded X</search>").observation.startswith("<information>Doc 1(Title: Ann Lee)")
    assert env.step("<answer>ann lee</answer>").reward == 10.0


def test_kb_questions_cached_file_roundtrip(cache):
    assert kb_questions(0) == generate_kb(0)[1]


@pytest.mark.slow
def test_workers_share_one_started_server(cache):
    """No URL configured: the workers start one retrieval server for the run and share it."""
    from alignopsd.engine.envs.manager import EnvManager

    tasks = [_task("popqa", "single"), _task("nq", "single")]
    with EnvManager("search", num_workers=2, step_timeout=120.0) as mgr:
        mgr.reset(tasks, group_n=1, seed=0)
        resp = [f"<think>t</think><search>{t.payload['support'][0]}</search>" for t in tasks]
        _, _, dones, infos = mgr.step(resp)
        assert not any(i["failed"] for i in infos), [i["failure"] for i in infos]
        urls = {i["retriever_url"] for i in infos}
        assert len(urls) == 1 and all(i["observation"].startswith("<information>Doc 1") for i in infos)


def test_skill_bank_has_the_four_task_types():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "engine" / "envs" / "search" / "skills"
    mapping = json.loads((root / "skill_mapping.json").read_text())
    types = {"entity_attribute_lookup", "direct_retrieval", "multi_hop_reasoning", "compare"}
    assert set(mapping["task_to_skill"]) == types == set(mapping["task_keywords"])
    assert set(mapping["skill_files"]) == types | {"general_skills"}
    for fname in mapping["skill_files"].values():
        assert (root / fname).read_text().startswith("# Search-QA")
