"""WebShop in its original text mode, over the generated catalogue or the original data (data.py).

Pages and clickables (lower-cased, as the original lists them; clicks match case-insensitively):

- search page: ``WebShop [SEP] Instruction: [SEP] <goal> [SEP] Search``; action ``search[<query>]``.
- results page: ``Back to Search``, ``Page p (Total results: n)``, ``< Prev`` (p > 1), ``Next >`` (more
  pages), then ASIN, title and price of each of up to 10 results (the top 50 BM25 hits, as the original).
  Clickables: ``back to search``, ``< prev``, ``next >``, the ASINs.
- item page: ``Back to Search``, ``< Prev``, each option name followed by its values, title, price,
  rating, ``Description``, ``Features``, ``Reviews``, ``Buy Now``. Clicking a value selects it.
- description / features / reviews pages: ``Back to Search``, ``< Prev`` (back to the item), the text.
- ``click[buy now]`` ends the episode with the original reward (below).

An action that names no admissible element (or the empty action the manager sends for a malformed
response) leaves the page unchanged, reward 0, and sets ``info["action_admissible"] = False``.
The episode ends on Buy Now or after ``max_steps`` (15).

Observation: the page's elements, each quoted, joined by `` [SEP] `` (the instruction is dropped there
because the prompt shows the task; verl-agent formats WebShop pages this way). The original text is in
``info["raw_observation"]``. Selected options are listed after the item page as ``You have clicked <v>.``.

Reward: the original ``get_reward`` (engine/envs/webshop/reward.py). Trainer reward: 10 when the score is 1, else 0
(``info["won"]``); the raw score is ``info["task_score"]``.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.base import StepResult, TaskSpec, percent
from alignopsd.engine.envs.prompts import PromptBuilder
from alignopsd.engine.envs.webshop.data import Catalogue, get_catalogue, normalise_source
from alignopsd.engine.envs.webshop.reward import get_reward

from alignopsd.actions import WEBSHOP_ACTION_RE

SUCCESS_REWARD = 10.0
RESULTS_PER_PAGE = 10
SEARCH_TOPK = 50
SEP = " [SEP] "

# ------------------------------------------------------------------------------------------ environment


def read_action(action: str) -> tuple[str | None, str | None]:
    """``search[x]`` / ``click[x]`` -> (verb, lower-cased argument with whitespace runs collapsed), else (None, None).

    The core's grammar (``alignopsd.actions.WEBSHOP_ACTION_RE``) matched against the lower-cased action: the
    environment reads it case-insensitively, as its catalogue text is lower-cased; an empty
    argument is no action. The teacher pass's action filter compares two actions by the method's own WebShop rule
    (``alignopsd.actions.webshop_actions_agree``, this environment's registry row), which reads the raw text
    case-sensitively (ALGORITHM.md §2.5, §7.18).
    """
    m = WEBSHOP_ACTION_RE.fullmatch(action.lower()) if isinstance(action, str) else None
    arg = " ".join(m.group(2).split()) if m is not None else ""
    return (m.group(1), arg) if m is not None and arg else (None, None)


class WebShopEnv:
    """One WebShop episode at a time (see the module docstring). Tasks carry the goal and catalogue source."""

    name = "webshop"

    def __init__(self, max_steps: int = 15, source: dict[str, Any] | None = None, **_: Any) -> None:
        if not isinstance(max_steps, int) or max_steps <= 0:
            raise ValueError(f"max_steps: expected a positive int, got {max_steps!r}")
        self.max_steps = max_steps
        self.default_source = source
        self.cat: Catalogue | None = None
        self.goal: dict[str, Any] = {}
        self.task: TaskSpec | None = None
        self.done = True

    # -- state ----------------------------------------------------------------------------------------

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        payload = task.payload or {}
        self.cat = get_catalogue(payload.get("source", self.default_source))
        goal = payload.get("goal")
        if goal is None:
            idx = payload.get("goal_index")
            if not isinstance(idx, int) or not 0 <= idx < len(self.cat.goals):
                raise ValueError(f"task: webshop payload needs 'goal' or a valid 'goal_index', got {payload!r}")
            goal = self.cat.goals[idx]
        for k in ("instruction_text", "attributes"):
            if k not in goal:
                raise ValueError(f"task: webshop goal lacks {k!r}")
        self.task, self.goal = task, goal
        self.page = "search"
        self.query = ""
        self.results: list[str] = []
        self.page_num = 1
        self.asin: str | None = None
        self.subpage = ""
        self.selected: dict[str, str] = {}
        self.steps = 0
        self.done = False
        self.bought: str | None = None
        obs, raw = self._observe()
        return obs, self._info(raw, valid=True)

    @property
    def instruction(self) -> str:
        return str(self.goal.get("instruction_text", ""))

    def _product(self) -> dict[str, Any]:
        assert self.cat is not None and self.asin is not None
        return self.cat.by_asin[self.asin]

    def _page_parts(self) -> tuple[list[str], list[str], bool]:
        """(page elements, clickables, has_search_bar) of the current page."""
        assert self.cat is not None
        if self.page == "search":
            return ["Search"], [], True
        if self.page == "results":
            n = len(self.results)
            parts = ["Back to Search", f"Page {self.page_num} (Total results: {n})"]
            clicks = ["back to search"]
            if self.page_num > 1:
                parts.append("< Prev")
                clicks.append("< prev")
            if self.page_num * RESULTS_PER_PAGE < n:
                parts.append("Next >")
                clicks.append("next >")
            lo = (self.page_num - 1) * RESULTS_PER_PAGE
            for asin in self.results[lo : lo + RESULTS_PER_PAGE]:
                p = self.cat.by_asin[asin]
                parts += [asin, p["Title"], p["Price"]]
                clicks.append(asin.lower())
            return parts, clicks, False
        p = self._product()
        if self.page == "item":
            parts = ["Back to Search", "< Prev"]
            clicks = ["back to search", "< prev"]
            for oname, values in p.get("options", {}).items():
                parts.append(oname)
                for v in values:
                    parts.append(v)
                    if v.lower() not in clicks:
                        clicks.append(v.lower())
            parts += [p["Title"], f"Price: {p['Price']}", f"Rating: {p.get('Rating', 'N.A.')}"]
            parts += ["Description", "Features", "Reviews", "Buy Now"]
            clicks += ["description", "features", "reviews", "buy now"]
            return parts, clicks, False
        # description / features / reviews
        parts = ["Back to Search", "< Prev"]
        if self.subpage == "description":
            parts.append(p.get("Description") or "N.A.")
        elif self.subpage == "features":
            parts += list(p.get("BulletPoints") or ["N.A."])
        else:
            reviews = p.get("Reviews") or []
            if not reviews:
                parts.append("N.A.")
            for r in reviews:
                parts += [str(r.get("title", "")), str(r.get("score", "")), str(r.get("body", ""))]
        return parts, ["back to search", "< prev"], False

    def _observe(self) -> tuple[str, str]:
        parts, _, _ = self._page_parts()
        if self.page == "search":
            raw = SEP.join(["WebShop", "Instruction:", self.instruction, *parts])
        else:
            raw = SEP.join(["Instruction:", self.instruction, *parts])
        obs = SEP.join(f"'{x}'" for x in parts)
        if self.page == "item" and self.selected:
            clicked = " ".join(f"You have clicked {v}." for v in self.selected.values())
            obs, raw = f"{obs}\n{clicked}", f"{raw}\n{clicked}"
        return obs, raw

    def admissible_actions(self) -> list[str]:
        _, clicks, has_search = self._page_parts()
        return (["search[<your query>]"] if has_search else []) + [f"click[{c}]" for c in clicks]

    def _info(self, raw: str, valid: bool, **extra: Any) -> dict[str, Any]:
        _, clicks, has_search = self._page_parts()
        assert self.task is not None
        info = {
            "task": self.instruction,
            "won": False,
            "task_score": 0.0,
            "action_admissible": valid,
            "admissible_actions": (["search[<your query>]"] if has_search else []) + [f"click[{c}]" for c in clicks],
            "available_actions": {"has_search_bar": has_search, "clickables": list(clicks)},
            "raw_observation": raw,
            "page": self.page,
            "category": self.task.category,
            "data_source": self.task.data_source,
        }
        info.update(extra)
        return info

    # -- actions --------------------------------------------------------------------------------------

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() called on a finished or unstarted episode")
        self.steps += 1
        verb, arg = read_action(action)
        _, clicks, has_search = self._page_parts()
        valid = False
        reward, score, detail = 0.0, 0.0, None
        if verb == "search" and has_search and arg and arg != "<your query>":
            valid = True
            assert self.cat is not None
            self.query = arg
            self.results = self.cat.search(arg, SEARCH_TOPK)
            self.page, self.page_num = "results", 1
        elif verb == "click" and arg in clicks:
            valid = True
            score, detail = self._click(arg)
        if self.done:
            won = score >= 1.0 - 1e-9
            reward = SUCCESS_REWARD if won else 0.0
            obs, raw = self._purchase_page(score, detail)
            info = self._info(
                raw,
                valid,
                won=won,
                task_score=score,
                reward_detail=detail,
                bought=self.bought,
                selected_options=dict(self.selected),
            )
            info["admissible_actions"], info["available_actions"] = [], {"has_search_bar": False, "clickables": []}
            return StepResult(obs, reward, True, info)
        obs, raw = self._observe()
        truncated = self.steps >= self.max_steps
        if truncated:
            self.done = True
        return StepResult(obs, 0.0, truncated, self._info(raw, valid, truncated=truncated))

    def _click(self, arg: str) -> tuple[float, dict[str, Any] | None]:
        assert self.cat is not None
        if arg == "back to search":
            self.page, self.results, self.asin, self.selected = "search", [], None, {}
        elif self.page == "results":
            if arg == "next >":
                self.page_num += 1
            elif arg == "< prev":
                self.page_num -= 1
            else:
                asin = next(a for a in self.results if a.lower() == arg)
                self.page, self.asin, self.selected = "item", asin, {}
        elif self.page == "item":
            if arg == "< prev":
                self.page, self.asin, self.selected = "results", None, {}
            elif arg in ("description", "features", "reviews"):
                self.page, self.subpage = "sub", arg
            elif arg == "buy now":
                p = self._product()
                score, detail = get_reward(p, self.goal, self.cat.prices[p["asin"]], self.selected)
                self.done, self.bought = True, p["asin"]
                return score, detail
            else:
                for oname, values in self._product().get("options", {}).items():
                    if arg in (v.lower() for v in values):
                        self.selected[oname] = next(v for v in values if v.lower() == arg)
                        break
        elif self.page == "sub" and arg == "< prev":
            self.page = "item"
        return 0.0, None

    def _purchase_page(self, score: float, detail: dict[str, Any] | None) -> tuple[str, str]:
        opts = ", ".join(f"{k}: {v}" for k, v in self.selected.items()) or "none"
        parts = [
            "Thank you for shopping with us!",
            "Purchased",
            f"asin: {self.bought}",
            f"options: {opts}",
            "Your score (min 0.0, max 1.0)",
            f"{score:.4f}",
        ]
        return SEP.join(f"'{x}'" for x in parts), SEP.join(["Instruction:", self.instruction, *parts])


# ----------------------------------------------------------------------------------------------- tasks


def find_original_files(data_dir: str | os.PathLike[str]) -> dict[str, str | None]:
    """Locate ``items_shuffle*.json``, ``items_ins_v2*.json`` and ``items_human_ins*.json`` in ``data_dir``."""
    d = Path(data_dir)
    if not d.is_dir():
        raise ValueError(f"data_dir: not a directory: {d}")

    def one(pattern: str) -> str | None:
        hits = sorted(glob.glob(str(d / pattern)))
        # prefer the full file over the 1000-product sample when both exist
        hits.sort(key=lambda h: ("1000" in Path(h).name, h))
        return hits[0] if hits else None

    products = one("items_shuffle*.json")
    if products is None:
        raise ValueError(f"data_dir: no items_shuffle*.json in {d}")
    return {"products": products, "attributes": one("items_ins_v2*.json"), "human_goals": one("items_human_ins*.json")}


def load_tasks(
    split: str = "train",
    n: int | None = None,
    seed: int = 0,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    source: dict[str, Any] | None = None,
    **_: Any,
) -> list[TaskSpec]:
    """WebShop tasks of ``split`` ("train" or "test"): the first ``n`` goals of the split (all when n is None).

    ``data_dir`` with the original files selects the original data (seeded with 233 as upstream unless
    ``source`` says otherwise); otherwise the generated catalogue of ``seed``. The order is the catalogue's
    seeded goal order, so the same arguments always give the same tasks.
    """
    if source is None:
        if data_dir is not None:
            source = {"kind": "original", **find_original_files(data_dir)}
        else:
            source = {"kind": "generated", "seed": seed}
    source = normalise_source(source)
    cat = get_catalogue(source)
    idx = cat.split(split)
    if n is not None and n > 0:
        idx = idx[:n]
    tasks = []
    for i in idx:
        g = cat.goals[i]
        tasks.append(
            TaskSpec(
                key=f"webshop-{split}-{i:05d}-{g['asin']}",
                env="webshop",
                category=str(g.get("category") or "unknown"),
                data_source="text",
                payload={"goal": g, "goal_index": i, "source": source},
            )
        )
    return tasks


# ---------------------------------------------------------------------------------------------- prompts

WEBSHOP_TEMPLATE_NO_HIS = """
You are an expert autonomous agent operating in the WebShop e-commerce platform.
Your task is to: {task_description}.
Your current observation is: {current_observation}.
Your admissible actions of the current situation are:
[
{available_actions}
].

Now it's your turn to take one action for the current step.
You should first reason step-by-step about the current situation, then think carefully which admissible \
action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags.
Once you've finished your reasoning, you should choose an admissible action for current step and present it \
within <action> </action> tags.
"""

WEBSHOP_TEMPLATE = """
You are an expert autonomous agent operating in the WebShop e-commerce platform.
Your task is to: {task_description}.
Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} \
observations and the corresponding actions you took: {action_history}
You are now at step {current_step} and your current observation is: {current_observation}.
Your admissible actions of the current situation are:
[
{available_actions}
].

Now it's your turn to take one action for the current step.
You should first reason step-by-step about the current situation, then think carefully which admissible \
action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags.
Once you've finished your reasoning, you should choose an admissible action for current step and present it \
within <action> </action> tags.
"""

MAX_PROMPT_CHARS = 13000


def webshop_prompt(history_length: int = 2) -> PromptBuilder:
    """§1.3 WebShop builder: task, formatted page, available actions, last ``history_length`` pairs; the
    no-history template when the rendered prompt exceeds 13,000 characters."""
    return PromptBuilder(
        WEBSHOP_TEMPLATE_NO_HIS,
        WEBSHOP_TEMPLATE,
        history_length,
        action_sep=",\n",
        exclude_actions=(),
        max_chars=MAX_PROMPT_CHARS,
    )


def table_columns(metrics: dict[str, float]) -> dict[str, float | None]:
    """The evaluation table: mean task score (Score) and success rate (Acc), in percent."""
    return {"Score": percent(metrics, "episode/task_score_mean"), "Acc": percent(metrics, "episode/success_rate")}
