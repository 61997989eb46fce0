"""Search-QA data: the generated knowledge base of fictional entities, and Search-R1's parquet/corpus files.

Generated knowledge base (``generate_kb``): countries, cities, people, organisations and creative works with
invented names, dates and attributes (so a pretrained model cannot know any answer; drawn by
engine/envs/search/world.py), one Wikipedia-style passage per entity in the Search-R1 corpus layout
(``{"id", "contents": "\\"Title\\"\\nText"}``), and
questions answerable only from those passages. Question kinds and the data-source label each carries (the
label drives the per-source accuracy table and the skill lookup of ALGORITHM.md §1.4):

| label | mimics | kind | example |
|---|---|---|---|
| ``popqa`` | PopQA | single-hop attribute of an entity | "What is Ardel Quenby's occupation?" |
| ``nq`` | Natural Questions | single-hop, lower-case factoid | "when was tavrin optics founded" |
| ``triviaqa`` | TriviaQA | single-hop, "which ..." phrasing | "Which river flows through Osmira?" |
| ``hotpotqa`` | HotpotQA | two-hop bridge | "What is the occupation of the founder of Tavrin Optics?" |
| ``2wikimultihopqa`` | 2Wiki | comparison | "Which company was founded earlier, Tavrin Optics or Morel Foods?"|
| ``musique`` | MuSiQue | two-hop composition | "In which city is the headquarters of the employer of Ardel Quenby?" |
| ``bamboogle`` | Bamboogle | two-hop composition | "In what year was the author of The Glass Orchard born?" |

Splits: per label, a seeded 25 % of the questions is test, the rest train. As in Search-R1, the train split
defaults to ``nq`` + ``hotpotqa`` and the test split to all seven labels.

Search-R1 files: ``load_searchr1_parquet`` reads its ``train.parquet`` / ``test.parquet`` (columns
``data_source``, ``question`` or ``prompt``, ``golden_answers`` or ``reward_model.ground_truth.target``);
``load_corpus`` in retriever.py reads its corpus jsonl.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.search.world import draw_world
from alignopsd.engine.infra.cache import atomic_cached_dir, cache_root

KB_VERSION = "kb-v2"
SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
TRAIN_SOURCES = ("nq", "hotpotqa")
TEST_FRACTION = 0.25


def generate_kb(
    seed: int = 0, n_people: int = 240, n_cities: int = 48, n_orgs: int = 80, n_works: int = 120
) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """(passages, questions) of the fictional knowledge base; a pure function of the arguments.

    passages: ``{"id", "contents"}``; questions: ``{"id", "question", "golden_answers", "data_source",
    "kind", "support"}`` (support: titles of the passages that hold the answer chain).
    """
    for name, v in (("n_people", n_people), ("n_cities", n_cities), ("n_orgs", n_orgs), ("n_works", n_works)):
        if v < 4:
            raise ValueError(f"{name}: need at least 4, got {v}")
    rng = random.Random(f"{KB_VERSION}:{seed}")
    world = draw_world(rng, n_people, n_cities, n_orgs, n_works)
    passages = _kb_passages(world)
    questions = _kb_questions(world, rng)  # draws after the world: the same stream as one long function
    return passages, questions


def _kb_passages(world: dict[str, Any]) -> list[dict[str, str]]:
    """One passage per entity, ``{"id", "contents"}`` with ``contents = '"Title"\\nText'`` (no randomness)."""
    countries, cities, people, orgs, works = (world[k] for k in ("countries", "cities", "people", "orgs", "works"))
    created: dict[str, list[dict[str, Any]]] = {}
    for w in works:
        created.setdefault(w["creator"], []).append(w)
    passages: list[dict[str, str]] = []

    def add(title: str, text: str) -> None:
        passages.append({"id": str(len(passages)), "contents": f'"{title}"\n{text}'})

    for c in countries:
        add(
            c["name"],
            f"{c['name']} is a country on {c['region']}. Its capital is {c['capital']} and its currency "
            f"is the {c['currency']}. The people of {c['name']} are called {c['adj']}.",
        )
    for c in cities:
        add(
            c["name"],
            f"{c['name']} is a city in {c['country']}, founded in {c['founded']}. The {c['river']} flows "
            f"through {c['name']}, which has a population of about {c['population']:,}.",
        )
    for p in people:
        he = p["gender"].capitalize()
        art = "an" if p["occupation"][0] in "aeiou" else "a"
        text = (
            f"{p['name']} (born {p['born']}) is {art} {p['occupation']}. {he} was born in {p['city']} and "
            f"works for {p['employer']}."
        )
        for w in created.get(p["name"], [])[:2]:
            text += f" {he} is known for the {w['kind']} {w['title']} ({w['year']})."
        add(p["name"], text)
    for o in orgs:
        add(
            o["name"],
            f"{o['name']} is a company in {o['industry']}, founded in {o['founded']} by {o['founder']}. "
            f"Its headquarters are in {o['city']}.",
        )
    for w in works:
        add(w["title"], f"{w['title']} is a {w['year']} {w['genre']} {w['kind']} {w['verb']} {w['creator']}.")

    return passages


def _kb_questions(world: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    """Single-hop, bridge and comparison questions over the world (comparisons draw pairs from ``rng``)."""
    questions: list[dict[str, Any]] = []
    seen: set[str] = set()

    def q(source: str, kind: str, text: str, answers: Sequence[str], support: Sequence[str]) -> None:
        if text.lower() in seen:
            return
        seen.add(text.lower())
        questions.append(
            {
                "id": f"{source}-{len(questions)}",
                "question": text,
                "golden_answers": list(answers),
                "data_source": source,
                "kind": kind,
                "support": list(support),
            }
        )

    _person_org_questions(world, q)
    _place_work_questions(world, q)
    _compare_questions(world, rng, q)
    return questions


def _person_org_questions(
    world: dict[str, Any], q: Callable[[str, str, str, Sequence[str], Sequence[str]], None]
) -> None:
    """Single-hop and bridge questions about the people and the companies, asked through ``q``."""
    people, orgs = world["people"], world["orgs"]
    city_by = {c["name"]: c for c in world["cities"]}
    person_by = {p["name"]: p for p in people}
    org_by = {o["name"]: o for o in orgs}
    for p in people:
        q("popqa", "single", f"What is {p['name']}'s occupation?", [p["occupation"]], [p["name"]])
        q("popqa", "single", f"In what city was {p['name']} born?", [p["city"]], [p["name"]])
        q("nq", "single", f"who does {p['name'].lower()} work for", [p["employer"]], [p["name"]])
        q("nq", "single", f"what year was {p['name'].lower()} born", [str(p["born"])], [p["name"]])
        org = org_by[p["employer"]]
        q(
            "musique",
            "bridge",
            f"In which city is the headquarters of the employer of {p['name']}?",
            [org["city"]],
            [p["name"], org["name"]],
        )
        city = city_by[p["city"]]
        q("hotpotqa", "bridge", f"In which country was {p['name']} born?", [city["country"]], [p["name"], city["name"]])
        q(
            "hotpotqa",
            "bridge",
            f"What river flows through the birthplace of {p['name']}?",
            [city["river"]],
            [p["name"], city["name"]],
        )
    for o in orgs:
        founder = person_by[o["founder"]]
        q("nq", "single", f"when was {o['name'].lower()} founded", [str(o["founded"])], [o["name"]])
        q("nq", "single", f"who founded {o['name'].lower()}", [o["founder"]], [o["name"]])
        q("popqa", "single", f"In what city is {o['name']} headquartered?", [o["city"]], [o["name"]])
        q(
            "hotpotqa",
            "bridge",
            f"What is the occupation of the founder of {o['name']}?",
            [founder["occupation"]],
            [o["name"], founder["name"]],
        )
        q(
            "hotpotqa",
            "bridge",
            f"In what year was the founder of {o['name']} born?",
            [str(founder["born"])],
            [o["name"], founder["name"]],
        )


def _place_work_questions(
    world: dict[str, Any], q: Callable[[str, str, str, Sequence[str], Sequence[str]], None]
) -> None:
    """Single-hop and bridge questions about the cities, the countries and the works, asked through ``q``."""
    countries, cities, works = world["countries"], world["cities"], world["works"]
    person_by = {p["name"]: p for p in world["people"]}
    for c in cities:
        q("triviaqa", "single", f"Which river flows through the city of {c['name']}?", [c["river"]], [c["name"]])
        q("triviaqa", "single", f"Which country is the city of {c['name']} in?", [c["country"]], [c["name"]])
        q("nq", "single", f"when was the city of {c['name'].lower()} founded", [str(c["founded"])], [c["name"]])
    for co in countries:
        q("triviaqa", "single", f"Which city is the capital of {co['name']}?", [co["capital"]], [co["name"]])
        q("popqa", "single", f"What is the currency of {co['name']}?", [co["currency"]], [co["name"]])
    for w in works:
        creator = person_by[w["creator"]]
        q("popqa", "single", f"Who is the {w['role']} of {w['title']}?", [w["creator"]], [w["title"]])
        q(
            "triviaqa",
            "single",
            f"Which year was the {w['kind']} {w['title']} released?",
            [str(w["year"])],
            [w["title"]],
        )
        q(
            "bamboogle",
            "bridge",
            f"In what year was the {w['role']} of {w['title']} born?",
            [str(creator["born"])],
            [w["title"], creator["name"]],
        )
        q(
            "bamboogle",
            "bridge",
            f"In what city was the {w['role']} of {w['title']} born?",
            [creator["city"]],
            [w["title"], creator["name"]],
        )
        q(
            "musique",
            "bridge",
            f"Who employs the {w['role']} of {w['title']}?",
            [creator["employer"]],
            [w["title"], creator["name"]],
        )


def _compare_questions(
    world: dict[str, Any], rng: random.Random, q: Callable[[str, str, str, Sequence[str], Sequence[str]], None]
) -> None:
    """Comparisons (2WikiMultihopQA-like) of pairs drawn from ``rng``: distinct values so there is one right
    answer."""
    people, orgs, cities = world["people"], world["orgs"], world["cities"]
    for _ in range(len(orgs)):
        a, b = rng.sample(orgs, 2)
        if a["founded"] != b["founded"]:
            first = a if a["founded"] < b["founded"] else b
            q(
                "2wikimultihopqa",
                "compare",
                f"Which company was founded earlier, {a['name']} or {b['name']}?",
                [first["name"]],
                [a["name"], b["name"]],
            )
    for _ in range(len(people) // 2):
        a, b = rng.sample(people, 2)
        if a["born"] != b["born"]:
            first = a if a["born"] < b["born"] else b
            q(
                "2wikimultihopqa",
                "compare",
                f"Which person was born first, {a['name']} or {b['name']}?",
                [first["name"]],
                [a["name"], b["name"]],
            )
    for _ in range(len(cities)):
        a, b = rng.sample(cities, 2)
        if a["founded"] != b["founded"]:
            old = a if a["founded"] < b["founded"] else b
            q(
                "2wikimultihopqa",
                "compare",
                f"Which city is older, {a['name']} or {b['name']}?",
                [old["name"]],
                [a["name"], b["name"]],
            )


def kb_dir(seed: int = 0) -> Path:
    """Cached folder holding ``corpus.jsonl`` and ``questions.json`` of the generated KB for ``seed``."""

    def _build(tmp: Path) -> None:
        passages, questions = generate_kb(seed)
        with (tmp / "corpus.jsonl").open("w", encoding="utf-8") as f:
            for p in passages:
                f.write(json.dumps(p) + "\n")
        (tmp / "questions.json").write_text(json.dumps(questions))

    return atomic_cached_dir(cache_root() / "search" / f"{KB_VERSION}-s{seed}", _build)


def default_corpus_path(seed: int = 0) -> Path:
    return kb_dir(seed) / "corpus.jsonl"


def kb_questions(seed: int = 0) -> list[dict[str, Any]]:
    return json.loads((kb_dir(seed) / "questions.json").read_text())


def split_questions(questions: list[dict[str, Any]], split: str, seed: int) -> list[dict[str, Any]]:
    """Seeded per-source split: the first 25 % (after a seeded shuffle) of each label is test."""
    if split not in ("train", "test"):
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
    out = []
    for source in SOURCES:
        rows = [x for x in questions if x["data_source"] == source]
        random.Random(f"split:{seed}:{source}").shuffle(rows)
        n_test = max(1, round(TEST_FRACTION * len(rows))) if rows else 0
        out += rows[:n_test] if split == "test" else rows[n_test:]
    return out


# ------------------------------------------------------------------------------------------- Search-R1

_QUESTION_RE = re.compile(r"Question:\s*(.*?)\s*(?:\n|$)", re.DOTALL)


def _as_list(x: Any) -> list[str]:
    if x is None:
        return []
    if isinstance(x, str):
        return [x]
    try:
        return [str(v) for v in list(x)]
    except TypeError:
        return [str(x)]


def load_searchr1_parquet(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows ``{"id", "question", "golden_answers", "data_source"}`` of a Search-R1 parquet file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"path: no such parquet file: {p}")
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is in the engine extra
        raise ImportError("reading Search-R1 parquet files needs pyarrow (pip install pyarrow)") from exc
    rows = pq.read_table(p).to_pylist()
    out = []
    for i, row in enumerate(rows):
        question = row.get("question")
        if not question:
            prompt = row.get("prompt")
            content = ""
            if isinstance(prompt, list) and prompt:
                content = str(prompt[-1].get("content", "")) if isinstance(prompt[-1], dict) else str(prompt[-1])
            elif isinstance(prompt, str):
                content = prompt
            found = _QUESTION_RE.findall(content)
            question = found[-1] if found else content.strip()
        answers = _as_list(row.get("golden_answers"))
        if not answers:
            rm = row.get("reward_model") or {}
            gt = rm.get("ground_truth") if isinstance(rm, dict) else None
            answers = _as_list(gt.get("target") if isinstance(gt, dict) else gt)
        if not question or not answers:
            raise ValueError(f"path: row {i} of {p} lacks a question or gold answers")
        source = str(row.get("data_source") or "unknown").lower()
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        rid = row.get("id") or extra.get("index", i)
        out.append(
            {
                "id": f"{source}-{rid}",
                "question": str(question).strip(),
                "golden_answers": answers,
                "data_source": source,
            }
        )
    return out
