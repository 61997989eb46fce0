"""Search-QA in the Search-R1 format.

The agent answers a question in at most ``max_steps`` = 4 turns. Each turn the manager hands the environment
the response's action wrapped in its tag (registry ``action_tags = ("search", "answer")``):

- ``<search>query</search>``: the retrieval server's top-3 passages come back as the observation
  ``<information>Doc 1(Title: t) text\\nDoc 2(...) ...</information>`` (Search-R1 rendering);
- ``<answer>text</answer>``: the episode ends; ``won`` = exact match of the answer against any gold answer
  after SQuAD normalisation (lower-case, punctuation and articles removed, whitespace collapsed).
- anything else (the empty action the manager sends for a malformed response included): Search-R1's
  "My previous action is invalid ..." observation, reward 0, the turn still counts.

Reward: 10 · EM, the same success scale as ALFWorld (10 · won) and WebShop (10 iff score 1); the raw EM
(0.0/1.0) is ``info["task_score"]``. Running out of turns ends the episode with reward 0.

Retrieval: ``retriever_url`` (any Search-R1 ``/retrieve`` server); else ``$ALIGNOPSD_RETRIEVER_URL``
(exported by ``retriever.ensure_retriever`` in the parent before the workers start: one shared server);
else this process starts our server for the corpus (``corpus_path``, default: the generated KB of the
task's ``kb_seed``). ``retriever_url="local"`` searches in-process without HTTP. A server that needs a bearer
token gets the one in ``retriever_token_file`` (``env.options``), else ``$ALIGNOPSD_RETRIEVER_TOKEN``
(engine/envs/search/retriever_auth.py); an ``https://`` server's certificate is verified against the system's
authorities, or those in ``retriever_ca_file``. Both are checked before a run loads anything (:func:`check_options`,
the pre-flight check of the registry entry).
"""

from __future__ import annotations

import functools
import os
import random
import re
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.base import StepResult, TaskSpec, percent
from alignopsd.engine.envs.prompts import PromptBuilder, PromptContext
from alignopsd.engine.envs.search.corpus_index import CorpusRetriever, Document
from alignopsd.engine.envs.search.data import (
    SOURCES,
    TRAIN_SOURCES,
    default_corpus_path,
    kb_questions,
    load_searchr1_parquet,
    split_questions,
)
from alignopsd.engine.envs.search.retriever import (
    URL_ENV_VAR,
    RetrieverClient,
    ensure_retriever,
    format_passages,
    same_origin_opener,
)
from alignopsd.engine.envs.search.retriever_auth import resolve_token

SUCCESS_REWARD = 10.0
TOPK = 3
INVALID_OBSERVATION = (
    "My previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again."
)

# ------------------------------------------------------------------------------------------- exact match


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles (a/an/the), collapse whitespace."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden_answers: str | Sequence[str]) -> bool:
    """True when the normalised prediction equals any normalised gold answer."""
    golds = [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


# --------------------------------------------------------------------------------------------- actions

_TAG_RE = re.compile(r"^\s*<(search|answer)\s*>(.*?)</\1\s*>\s*$", re.IGNORECASE | re.DOTALL)


def parse_search_action(action: str) -> tuple[str | None, str]:
    """``<search>q</search>`` / ``<answer>a</answer>`` -> (kind, stripped text); else (None, "")."""
    if not isinstance(action, str):
        return None, ""
    m = _TAG_RE.match(action)
    if m is None or not m.group(2).strip():
        return None, ""
    return m.group(1).lower(), " ".join(m.group(2).split())


@functools.lru_cache(maxsize=4)
def _local_retriever(corpus_path: str) -> CorpusRetriever:
    return CorpusRetriever.from_path(corpus_path)


def check_options(options: dict[str, Any], environ: Mapping[str, str]) -> None:
    """The pre-flight check of ``env.options`` (the registry entry's ``check_options``): the retriever's token (the
    token file's, else ``$ALIGNOPSD_RETRIEVER_TOKEN``'s) can travel as a header, and the CA file loads; ValueError
    (one line) otherwise."""
    resolve_token(options.get("retriever_token_file"), environ)
    if options.get("retriever_ca_file"):
        same_origin_opener(options["retriever_ca_file"])


class SearchEnv:
    """One Search-QA episode at a time (see the module docstring)."""

    name = "search"

    def __init__(
        self,
        retriever_url: str | None = None,
        corpus_path: str | os.PathLike[str] | None = None,
        topk: int = TOPK,
        max_steps: int = 4,
        timeout: float = 15.0,
        retries: int = 3,
        retriever_token_file: str | os.PathLike[str] | None = None,
        retriever_ca_file: str | os.PathLike[str] | None = None,
        **_: Any,
    ) -> None:
        if not isinstance(max_steps, int) or max_steps <= 0:
            raise ValueError(f"max_steps: expected a positive int, got {max_steps!r}")
        if not isinstance(topk, int) or topk <= 0:
            raise ValueError(f"topk: expected a positive int, got {topk!r}")
        self.retriever_url = retriever_url
        self.corpus_path = str(corpus_path) if corpus_path else None
        self.topk, self.max_steps, self.timeout, self.retries = topk, max_steps, timeout, retries
        self.token = resolve_token(retriever_token_file)  # the file's, else $ALIGNOPSD_RETRIEVER_TOKEN's, else None
        self.ca_file = retriever_ca_file
        self._clients: dict[str, RetrieverClient] = {}
        self.last_url = "local" if retriever_url == "local" else None
        self.task: TaskSpec | None = None
        self.done = True

    def _retrieve(self, query: str) -> list[Document]:
        assert self.task is not None
        if self.retriever_url == "local":
            if self.corpus_path is None and "kb_seed" not in self.task.payload:
                raise ValueError("corpus_path: local retrieval of tasks not from the generated KB needs a corpus")
            corpus = self.corpus_path or str(default_corpus_path(int(self.task.payload["kb_seed"])))
            hits = _local_retriever(corpus).retrieve([query], self.topk)[0]
            return [Document(h["document"]["id"], h["document"]["contents"]) for h in hits]
        url = self.retriever_url
        if not url:
            corpus = self.corpus_path
            if corpus is None and not os.environ.get(URL_ENV_VAR):
                if "kb_seed" not in self.task.payload:
                    raise ValueError("retriever_url: tasks not from the generated KB need retriever_url or corpus_path")
                corpus = str(default_corpus_path(int(self.task.payload["kb_seed"])))
            url = ensure_retriever(corpus_path=corpus)
        if url not in self._clients:
            self._clients[url] = RetrieverClient(
                url, timeout=self.timeout, retries=self.retries, token=self.token, ca_file=self.ca_file
            )
        self.last_url = url
        return self._clients[url].retrieve([query], self.topk)[0]

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        payload = task.payload or {}
        question, golds = payload.get("question"), payload.get("golden_answers")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"task: search payload needs a non-empty 'question', got {payload!r}")
        if not golds or isinstance(golds, str) and not golds.strip():
            raise ValueError(f"task: search payload needs 'golden_answers', got {payload!r}")
        self.task = task
        self.question = question.strip()
        self.golds = [golds] if isinstance(golds, str) else [str(g) for g in golds]
        self.steps = 0
        self.done = False
        self.queries: list[str] = []
        return self.question, self._info()

    def _info(self, **extra: Any) -> dict[str, Any]:
        assert self.task is not None
        info = {
            "task": self.question,
            "won": False,
            "task_score": 0.0,
            "admissible_actions": [],
            "action_admissible": True,
            "category": self.task.category,
            "data_source": self.task.data_source,
            "n_searches": len(self.queries),
        }
        info.update(extra)
        return info

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() called on a finished or unstarted episode")
        self.steps += 1
        kind, text = parse_search_action(action)
        if kind == "answer":
            self.done = True
            em = exact_match(text, self.golds)
            obs = f"Your answer '{text}' is {'correct' if em else 'incorrect'}."
            info = self._info(won=em, task_score=float(em), answer=text, golden_answers=list(self.golds))
            return StepResult(obs, SUCCESS_REWARD if em else 0.0, True, info)
        if kind == "search":
            self.queries.append(text)
            docs = self._retrieve(text)
            obs = f"<information>{format_passages(docs)}</information>"
            info = self._info(search_query=text, retrieved_ids=[d.id for d in docs], retriever_url=self.last_url)
        else:
            obs = INVALID_OBSERVATION
            info = self._info(action_admissible=False)
        if self.steps >= self.max_steps:
            self.done = True
            info.update(truncated=True, golden_answers=list(self.golds))
        return StepResult(obs, 0.0, self.done, info)


# ----------------------------------------------------------------------------------------------- tasks


def load_tasks(
    split: str = "train",
    n: int | None = None,
    seed: int = 0,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    sources: Sequence[str] | None = None,
    kb_seed: int | None = None,
    **_: Any,
) -> list[TaskSpec]:
    """Search-QA tasks of ``split``; a seeded shuffle, then the first ``n`` (all when n is None).

    ``data_dir`` with Search-R1's ``train.parquet`` / ``test.parquet`` selects that data; otherwise the
    generated KB (``kb_seed``, default ``seed``). ``sources`` restricts the data sources (generated default:
    nq + hotpotqa for train, all seven for test).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
    if data_dir is not None:
        path = Path(data_dir) / f"{split}.parquet"
        rows = load_searchr1_parquet(path)
        extra: dict[str, Any] = {}
    else:
        ks = seed if kb_seed is None else int(kb_seed)
        rows = split_questions(kb_questions(ks), split, ks)
        if sources is None:
            sources = TRAIN_SOURCES if split == "train" else SOURCES
        extra = {"kb_seed": ks}
    if sources is not None:
        wanted = {s.lower() for s in sources}
        rows = [r for r in rows if r["data_source"] in wanted]
    rows = list(rows)
    random.Random(f"search-tasks:{split}:{seed}").shuffle(rows)
    if n is not None and n > 0:
        rows = rows[:n]
    tasks = []
    for r in rows:
        payload = {"question": r["question"], "golden_answers": list(r["golden_answers"]), **extra}
        for k in ("kind", "support"):  # question kind and supporting passage titles (never shown to the agent)
            if k in r:
                payload[k] = r[k]
        tasks.append(
            TaskSpec(
                key=f"search-{split}-{r['id']}",
                env="search",
                category=r["data_source"],
                data_source=r["data_source"],
                payload=payload,
            )
        )
    return tasks


# ---------------------------------------------------------------------------------------------- prompts

SEARCH_TEMPLATE_NO_HIS = """
You are an expert agent tasked with answering the given question step-by-step.
Your question: {task_description}

Now it's your turn to respond for the current step.
You should first conduct a reasoning process. This process MUST be enclosed within <think> </think> tags.
After completing your reasoning, choose only one of the following actions (do not perform both):
(1) If any required knowledge is missing or uncertain, you MUST call a search engine to get more external \
knowledge. This search process MUST be enclosed within <search> </search> tags.
(2) Only if you have sufficient information to answer the question with high confidence, provide your final \
answer within <answer> </answer> tags. Note: The final answer must be concise. For example, <answer>Beijing</answer>.
"""

SEARCH_TEMPLATE = """
You are an expert agent tasked with answering the given question step-by-step.
Your question: {task_description}

Prior to this step, you have already taken {step_count} step(s). Below is the interaction history where \
<search> </search> wrapped your past search queries and <information> </information> wrapped the corresponding \
search results returned by the external search engine. History:
{action_history}

Now it's your turn to respond for the current step.
You should first conduct a reasoning process. This process MUST be enclosed within <think> </think> tags.
After completing your reasoning, choose only one of the following actions (do not perform both):
(1) If any required knowledge is missing or uncertain, you MUST call a search engine to get more external \
knowledge. This search process MUST be enclosed within <search> </search> tags.
(2) Only if you have sufficient information to answer the question with high confidence, provide your final \
answer within <answer> </answer> tags. Note: The final answer must be concise. For example, <answer>Beijing</answer>.
"""


class SearchPromptBuilder(PromptBuilder):
    """History = the last k (search query, retrieved information) pairs: the action of step j is paired with
    the observation that followed it (the generic builder pairs each action with the one before it)."""

    def fields(self, ctx: PromptContext) -> dict[str, Any]:
        values = super().fields(ctx)
        pairs = []
        for j, (_, act) in enumerate(ctx.history):
            after = ctx.history[j + 1][0] if j + 1 < len(ctx.history) else ctx.observation
            pairs.append((j + 1, act, after))
        shown = pairs[-self.history_length :] if self.history_length else []
        values["action_history"] = "\n".join(f"Step {i}:\n<search> {a} </search>\n{obs}" for i, a, obs in shown)
        values["memory_context"] = values["action_history"]
        values["history_length"] = len(shown)
        return values


def search_prompt(history_length: int = 4) -> PromptBuilder:
    """§1.3 Search builder: the question plus the last ``history_length`` (4) search/information pairs."""
    return SearchPromptBuilder(SEARCH_TEMPLATE_NO_HIS, SEARCH_TEMPLATE, history_length, exclude_actions=())


TABLE_COLUMNS = (("nq", "NQ"), ("triviaqa", "TriviaQA"), ("popqa", "PopQA"), ("hotpotqa", "HotpotQA"),
                 ("2wikimultihopqa", "2Wiki"), ("musique", "Musique"), ("bamboogle", "Bamboogle"))  # fmt: skip


def table_columns(metrics: dict[str, float]) -> dict[str, float | None]:
    """The evaluation table: accuracy per data source (the paper's seven, then any other), and their average (Avg),
    in percent."""
    out: dict[str, float | None] = {label: percent(metrics, f"episode/accuracy/{key}") for key, label in TABLE_COLUMNS}
    present = [v for v in out.values() if v is not None]
    known = dict(TABLE_COLUMNS)
    for src in sorted(k.split("/")[-1] for k in metrics if k.startswith("episode/accuracy/")):
        if src not in known:
            out[src] = 100.0 * metrics[f"episode/accuracy/{src}"]
            present.append(out[src])
    out["Avg"] = sum(present) / len(present) if present else None
    return out
