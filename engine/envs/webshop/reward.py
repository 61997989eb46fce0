"""The WebShop reward, as the original environment computes it.

Reward (the original ``get_reward``)::

    r = r_type * (n_attr_matched + n_option_matched + [price <= price_upper]) / (n_attrs + n_options + 1)

- attribute matched: fuzzy token-set ratio > 85 against a product attribute, or the attribute text
  occurs in the title, the feature bullets or the description;
- option matched: fuzzy token-set ratio > 85 between colour-normalised option strings;
- ``r_type`` from query match, product-category match (two shared "›" levels) and the noun overlap of the
  product names: 1.0; 0.5 when none of the three match; 0.1 when the noun overlap is < 0.1; 0 when it is 0.

Documented simplifications: the original tags nouns with spaCy; here the "nouns" of a name are its
alphabetic words minus stopwords, colour words and a short adjective list. Fuzzy ratios use difflib's
``SequenceMatcher`` (the pure-Python path of fuzzywuzzy). A goal without a price bound counts the price as
matched. Trainer reward: 10 when the score is 1, else 0 (``info["won"]``); the raw score is
``info["task_score"]``. Score = mean task_score × 100, Acc = fraction of episodes with task_score 1
(``webshop_metrics``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any

# the original normalize.py colour list (first hit in this order wins)
COLOR_SET = [
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal",
    "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite",
    "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon",
    "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha",
    "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink",
    "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger", "turquoise",
    "violet", "walnut", "wheat", "white", "wine", "yellow",
]  # fmt: skip
_STOPWORDS = frozenset(
    "a an the and or of for with in on at to by from is are be this that these those it its as up out into over "
    "your you our we i my me set pack count inch inches ft oz ounce fl lb pound x".split()
)
_ADJECTIVES = frozenset(
    "new premium classic modern deluxe original signature essential everyday basic pro soft large small medium "
    "extra long short high low light dark best great natural portable lightweight heavy duty slim compact "
    "professional quality durable adjustable".split()
)


def _full_process(s: str) -> str:
    return re.sub(r"\W+", " ", s.lower()).strip()


def _ratio(a: str, b: str) -> int:
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def token_set_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy's ``fuzz.token_set_ratio`` (0-100) with its default processing."""
    p1, p2 = _full_process(str(s1)), _full_process(str(s2))
    if not p1 or not p2:
        return 0
    t1, t2 = set(p1.split()), set(p2.split())
    sect = " ".join(sorted(t1 & t2))
    c12 = (sect + " " + " ".join(sorted(t1 - t2))).strip()
    c21 = (sect + " " + " ".join(sorted(t2 - t1))).strip()
    return max(_ratio(sect, c12), _ratio(sect, c21), _ratio(c12, c21))


def normalize_color(text: str) -> str:
    for c in COLOR_SET:
        if c in text:
            return c
    return text


def noun_tokens(name: str) -> set[str]:
    """Stand-in for the original's spaCy NOUN/PROPN tokens of a product name (see the module docstring)."""
    words = re.findall(r"[a-z]+", name.lower())
    return {w for w in words if len(w) > 1 and w not in _STOPWORDS and w not in _ADJECTIVES and w not in COLOR_SET}


def type_reward(product: dict[str, Any], goal: dict[str, Any]) -> dict[str, Any]:
    query_match = str(product.get("query", "")).lower().strip() == str(goal.get("query", "")).lower().strip()
    p_cat = {x.strip() for x in str(product.get("product_category", "")).split("›") if x.strip()}
    g_cat = {x.strip() for x in str(goal.get("product_category", "")).split("›") if x.strip()}
    category_match = len(p_cat & g_cat) >= 2
    desired = noun_tokens(str(goal.get("name", "")))
    purchased = noun_tokens(str(product.get("name", product.get("Title", ""))))
    title_score = 0.2 if not desired else len(purchased & desired) / len(desired)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match, "title_score": title_score}


def attribute_matches(product: dict[str, Any], goal_attrs: Sequence[str]) -> int:
    title = str(product.get("Title", "")).lower()
    bullets = " ".join(product.get("BulletPoints", [])).lower()
    desc = str(product.get("Description", "")).lower()
    n = 0
    for g in goal_attrs:
        if any(token_set_ratio(p, g) > 85 for p in product.get("Attributes", [])):
            n += 1
        elif g in title or g in bullets or g in desc:
            n += 1
    return n


def option_matches(purchased_options: Iterable[str], goal_options: Iterable[str]) -> int:
    purchased = [normalize_color(str(o)) for o in purchased_options]
    n = 0
    for g in (normalize_color(str(o)) for o in goal_options):
        if any(token_set_ratio(p, g) > 85 for p in purchased):
            n += 1
    return n


def get_reward(
    product: dict[str, Any], goal: dict[str, Any], price: float, options: dict[str, str]
) -> tuple[float, dict[str, Any]]:
    """The original WebShop reward of buying ``product`` at ``price`` with ``options`` selected, for ``goal``."""
    goal_options = goal.get("goal_options") or []
    if isinstance(goal_options, dict):
        goal_options = list(goal_options.values())
    attrs = list(goal.get("attributes") or [])
    upper = float(goal.get("price_upper") or 0)
    r_price = (price <= upper) if upper > 0 else True
    n_attr = attribute_matches(product, attrs)
    n_opt = option_matches(options.values(), goal_options)
    t = type_reward(product, goal)
    total = (n_attr + n_opt + float(r_price)) / (len(attrs) + len(goal_options) + 1) * t["r_type"]
    detail = dict(
        t,
        r_price=bool(r_price),
        n_attr_matched=n_attr,
        n_attrs=len(attrs),
        n_option_matched=n_opt,
        n_options=len(goal_options),
    )
    return float(total), detail


def webshop_metrics(task_scores: Sequence[float]) -> dict[str, float]:
    """Score = mean task score × 100; Acc = fraction with task score 1 (the paper's WebShop columns)."""
    scores = [float(s) for s in task_scores]
    if not scores:
        raise ValueError("task_scores: empty")
    return {
        "score": 100.0 * sum(scores) / len(scores),
        "acc": sum(s >= 1.0 - 1e-9 for s in scores) / len(scores),
        "n": float(len(scores)),
    }
