"""WebShop data: the generated offline catalogue and goal set, and the adapter for the original WebShop files.

Both produce the same normalised layout, the one the original engine builds in ``load_products`` /
``get_human_goals`` (so ``env.py`` and its reward work on either):

product: ``asin, name, Title, category, query, product_category ("A › B › C"), Description,
BulletPoints (list), Reviews (list of {title, body, score}), Rating, pricing (1 or 2 floats), Price (tag),
options ({option name: [lower-cased values]}), Attributes (list)``.

goal: ``asin, category, query, name, product_category, instruction_text, attributes, goal_options
(list of option values), price_upper, weight``.

Generated catalogue: ``generate_catalogue`` (engine/envs/webshop/generate.py), a function of its seed.

Original data (``load_original``): ``items_shuffle*.json`` (list of scraped products), ``items_ins_v2*.json``
(asin -> {attributes, instruction, instruction_attributes}) and, optionally, ``items_human_ins.json``
(asin -> [{instruction, instruction_attributes, instruction_options}]). With human instructions the goals are
the original human goals; without, the original synthetic goals (one per option combination, capped).
Reviews live in a separate file upstream that the released text environment does not load; they are empty.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import random
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.search.corpus_index import Bm25Index
from alignopsd.engine.envs.webshop.generate import (
    CATALOGUE_VERSION,
    DEFAULT_N_GOALS,
    DEFAULT_N_PRODUCTS,
    INDEX_LAYOUT,
    MAX_TEST_GOALS,
    generate_catalogue,
    generate_product_prices,
    price_bound,
    price_tag,
)

# ------------------------------------------------------------------------------------------- original data


def _load_json(path: str | os.PathLike[str], what: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: no such file: {p}")
    with p.open(encoding="utf-8") as f:
        return json.load(f)


def _parse_pricing(pricing: Any) -> list[float]:
    if not pricing:
        return [100.0]
    if isinstance(pricing, (int, float)):
        return [float(pricing)]
    if isinstance(pricing, list):
        return [float(x) for x in pricing][:2]
    vals = [float(Decimal(re.sub(r"[^\d.]", "", s))) for s in str(pricing).split("$")[1:] if re.sub(r"[^\d.]", "", s)]
    return vals[:2] if vals else [100.0]


def load_original(
    products_path: str | os.PathLike[str],
    attributes_path: str | os.PathLike[str] | None = None,
    human_goals_path: str | os.PathLike[str] | None = None,
    seed: int = 233,
    max_options_per_product: int = 10,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """Products, goals and prices from the original WebShop JSON files (the original ``load_products`` rules)."""
    raw = _load_json(products_path, "products_path")
    if not isinstance(raw, list):
        raise ValueError("products_path: expected a JSON list of products (items_shuffle layout)")
    attributes = _load_json(attributes_path, "attributes_path") if attributes_path else {}
    human = _load_json(human_goals_path, "human_goals_path") if human_goals_path else None
    products = _original_products(raw, attributes, human)
    if not products:
        raise ValueError(f"products_path: no usable products in {products_path}")
    prices = generate_product_prices(products, seed)
    goals = _original_goals(products, prices, human is not None, seed, max_options_per_product)
    if not goals:
        raise ValueError("goals: the given files yield no goal (no instruction with attributes)")
    return products, goals, prices


def _original_products(
    raw: list[Any], attributes: dict[str, Any], human: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The normalised products of ``load_original`` (the original ``load_products`` rules), with each product's
    human instructions or synthetic instruction attached for ``_original_goals``."""
    products: list[dict[str, Any]] = []
    seen: set[str] = set()
    for p in raw:
        asin = str(p.get("asin", ""))
        if asin in ("", "nan") or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        pricing = _parse_pricing(p.get("pricing"))
        options: dict[str, list[str]] = {}
        for oname, contents in (p.get("customization_options") or {}).items():
            if contents is None:
                continue
            options[oname.lower()] = [str(c["value"]).strip().replace("/", " | ").lower() for c in contents]
        small = p.get("small_description", [])
        bullets = small if isinstance(small, list) else [small]
        attrs = attributes.get(asin, {}).get("attributes") if isinstance(attributes.get(asin), dict) else None
        prod = {
            "asin": asin,
            "name": p.get("name", ""),
            "Title": p.get("name", ""),
            "category": p.get("category", ""),
            "query": str(p.get("query", "")).lower().strip(),
            "product_category": p.get("product_category", ""),
            "Description": p.get("full_description", "") or "",
            "BulletPoints": [str(b) for b in bullets if b],
            "Reviews": [],
            "Rating": "N.A.",
            "pricing": pricing,
            "Price": price_tag(pricing),
            "options": options,
            "Attributes": attrs or ["DUMMY_ATTR"],
        }
        info = attributes.get(asin) if isinstance(attributes.get(asin), dict) else {}
        if human is not None and asin in human:
            prod["instructions"] = human[asin]
        elif info.get("instruction"):
            prod["instruction_text"] = info.get("instruction")
            prod["instruction_attributes"] = info.get("instruction_attributes") or []
        products.append(prod)
    return products


def _original_goals(
    products: list[dict[str, Any]], prices: dict[str, float], human: bool, seed: int, max_options_per_product: int
) -> list[dict[str, Any]]:
    """Goals of ``load_original``: the human instructions, else one synthetic goal per option combination
    (at most ``max_options_per_product``); price bounds drawn in product order from ``Random(seed)``."""
    rng = random.Random(seed)
    goals: list[dict[str, Any]] = []
    for p in products:
        base = {k: p[k] for k in ("asin", "category", "query", "product_category")} | {"name": p["Title"]}
        if human:
            for ins in p.get("instructions", []):
                attrs = ins.get("instruction_attributes") or []
                if not attrs:
                    continue
                upper, price_text = price_bound(rng, prices[p["asin"]])
                opts = ins.get("instruction_options") or []
                goals.append(
                    base
                    | {
                        "instruction_text": str(ins["instruction"]).strip(".") + price_text,
                        "attributes": list(attrs),
                        "goal_options": list(opts.values()) if isinstance(opts, dict) else list(opts),
                        "price_upper": upper,
                        "weight": 1,
                    }
                )
        elif p.get("instruction_text"):
            attrs = p["instruction_attributes"]
            if not attrs:
                continue
            upper, price_text = price_bound(rng, prices[p["asin"]])
            names = sorted(p["options"])
            all_combos = itertools.product(*(p["options"][n] for n in names))
            combos = list(itertools.islice(all_combos, max_options_per_product))
            for combo in combos:
                opts = dict(zip(names, combo))
                opt_text = ", and ".join(f"{k}: {v}" for k, v in opts.items())
                opt_text = " with " + opt_text if opt_text else ""
                goals.append(
                    base
                    | {
                        "instruction_text": f"{p['instruction_text']}{opt_text}{price_text}",
                        "attributes": list(attrs),
                        "goal_options": list(opts.values()),
                        "price_upper": upper,
                        "weight": 1,
                    }
                )
    return goals


def write_original_layout(
    products: list[dict[str, Any]], goals: list[dict[str, Any]], out_dir: str | os.PathLike[str]
) -> dict[str, str]:
    """Write products and goals in the original WebShop file layout (``items_shuffle.json``,
    ``items_ins_v2.json``, ``items_human_ins.json``), so the generated catalogue can be read back by
    ``load_original`` or served by the upstream WebShop (``alignopsd games webshop``). Price bounds are re-drawn
    on reading, as upstream."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items, attrs, human = [], {}, {}
    for p in products:
        pricing = "".join(f"${x}" for x in p["pricing"])
        options = {k: [{"value": v, "image": None} for v in vals] for k, vals in p["options"].items()}
        items.append(
            {
                "asin": p["asin"],
                "name": p["Title"],
                "full_description": p["Description"],
                "small_description": list(p["BulletPoints"]),
                "pricing": pricing,
                "customization_options": options or None,
                "category": p["category"],
                "query": p["query"],
                "product_category": p["product_category"],
                "images": [""],
            }
        )
        attrs[p["asin"]] = {"attributes": list(p["Attributes"])}
    for g in goals:
        text = re.sub(r", and price lower than [0-9.]+ dollars$", "", g["instruction_text"])
        human.setdefault(g["asin"], []).append(
            {
                "asin": g["asin"],
                "instruction": text,
                "instruction_attributes": list(g["attributes"]),
                "instruction_options": list(g["goal_options"]),
            }
        )
    paths = {
        "products": out / "items_shuffle.json",
        "attributes": out / "items_ins_v2.json",
        "human_goals": out / "items_human_ins.json",
    }
    for key, obj in (("products", items), ("attributes", attrs), ("human_goals", human)):
        paths[key].write_text(json.dumps(obj), encoding="utf-8")
    return {k: str(v) for k, v in paths.items()}


# --------------------------------------------------------------------------------------------- catalogue


class Catalogue:
    """Products, goals, fixed prices and a BM25 search over the products (built lazily, cached on disk)."""

    def __init__(
        self,
        products: list[dict[str, Any]],
        goals: list[dict[str, Any]],
        prices: dict[str, float],
        key: str,
        seed: int = 0,
    ) -> None:
        self.products = products
        self.by_asin = {p["asin"]: p for p in products}
        self.prices = prices
        self.key = key
        # the original shuffles its goal list once with a fixed seed; test = the head of that list
        self.goals = list(goals)
        random.Random(seed).shuffle(self.goals)
        self._index: Bm25Index | None = None

    @property
    def n_test(self) -> int:
        return min(MAX_TEST_GOALS, max(1, round(0.25 * len(self.goals))))

    def split(self, split: str) -> list[int]:
        """Goal indices of ``split``: "test" (the first ``n_test`` goals) or "train" (the rest)."""
        if split == "test":
            return list(range(self.n_test))
        if split == "train":
            return list(range(self.n_test, len(self.goals)))
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")

    @staticmethod
    def search_text(p: dict[str, Any]) -> str:
        """The original index document: title, description, first feature bullet and the option lists."""
        opts = ", and ".join(f"{k}: {', '.join(v)}" for k, v in p.get("options", {}).items())
        first_bullet = p["BulletPoints"][0] if p.get("BulletPoints") else ""
        return " ".join([p["Title"], p["Description"], first_bullet, opts]).lower()

    @property
    def index(self) -> Bm25Index:
        if self._index is None:
            key = f"{self.key}-{INDEX_LAYOUT}"
            self._index = Bm25Index.cached(key, lambda: [self.search_text(p) for p in self.products])
        return self._index

    def search(self, query: str, k: int = 50) -> list[str]:
        """ASINs of the top-``k`` products for ``query`` (the original returns 50 results)."""
        return [self.products[i]["asin"] for i, _ in self.index.search(query, k)]


def _source_key(source: dict[str, Any]) -> str:
    kind = source.get("kind", "generated")
    if kind == "generated":
        return f"{CATALOGUE_VERSION}-s{source.get('seed', 0)}-p{source.get('n_products', DEFAULT_N_PRODUCTS)}" + (
            f"-g{source.get('n_goals', DEFAULT_N_GOALS)}"
        )
    h = hashlib.sha1()
    for name in ("products", "attributes", "human_goals"):
        path = source.get(name)
        if path:
            st = Path(path).stat()
            h.update(f"{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"webshop-orig-{h.hexdigest()[:16]}-s{source.get('seed', 233)}"


def normalise_source(source: dict[str, Any] | None) -> dict[str, Any]:
    """Fill defaults: ``{"kind": "generated", "seed", "n_products", "n_goals"}`` or
    ``{"kind": "original", "products", "attributes", "human_goals", "seed"}``."""
    source = dict(source or {})
    kind = source.setdefault("kind", "generated")
    if kind == "generated":
        source.setdefault("seed", 0)
        source.setdefault("n_products", DEFAULT_N_PRODUCTS)
        source.setdefault("n_goals", DEFAULT_N_GOALS)
    elif kind == "original":
        if not source.get("products"):
            raise ValueError("source.products: the original data needs the path of items_shuffle*.json")
        source.setdefault("attributes", None)
        source.setdefault("human_goals", None)
        source.setdefault("seed", 233)
    else:
        raise ValueError(f"source.kind: expected 'generated' or 'original', got {kind!r}")
    return source


@functools.lru_cache(maxsize=4)
def _catalogue_cached(key_json: str) -> Catalogue:
    source = json.loads(key_json)
    if source["kind"] == "generated":
        products, goals, prices = generate_catalogue(source["seed"], source["n_products"], source["n_goals"])
    else:
        products, goals, prices = load_original(
            source["products"], source["attributes"], source["human_goals"], seed=source["seed"]
        )
    return Catalogue(products, goals, prices, _source_key(source), seed=source["seed"])


def get_catalogue(source: dict[str, Any] | None = None) -> Catalogue:
    """The catalogue of ``source`` (see ``normalise_source``); built once per process."""
    return _catalogue_cached(json.dumps(normalise_source(source), sort_keys=True))
