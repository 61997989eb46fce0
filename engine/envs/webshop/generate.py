"""The generated offline WebShop catalogue and goal set (layout: engine/envs/webshop/data.py).

The original's five categories (beauty, electronics, fashion, food, furniture), 8 product types each
(webshop_products.py), with fictional brands. Each product of a type gets a random subset of the type's
attribute pool and of each option pool, so products of one type differ in exactly the things an instruction
asks for, and a search returns many near misses. Goals pick a product, 1-3 of its attributes, one value of most
of its options, and a price bound drawn as the original does (two of the next four multiples of 10 above the
price, the larger one). Everything is a function of the seed.
"""

from __future__ import annotations

import random
from typing import Any

from alignopsd.engine.envs.webshop.products import PRODUCT_TYPES, ProductType

CATALOGUE_VERSION = "webshop-gen-v1"
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # the original's price bounds
DEFAULT_N_PRODUCTS = 2400
DEFAULT_N_GOALS = 2000
MAX_TEST_GOALS = 500  # the original holds out goals[0:500] as the test split
INDEX_LAYOUT = "doc2"  # bump when search_text changes (the on-disk index is keyed by it)

_SYL_A = ["ka", "ve", "lo", "dra", "mi", "no", "sa", "ter", "qui", "bel", "zor", "fen", "ul", "ras", "vin", "ost"]
_SYL_B = ["ra", "ven", "lis", "dor", "ma", "tix", "na", "vo", "rel", "zen", "ko", "sta", "lux", "mir", "ta", "lo"]
_ADJ = ["premium", "classic", "everyday", "essential", "modern", "deluxe", "signature", "original", "pro", "basic"]
_FILLER = [
    "Designed for daily use and built to last.",
    "A dependable choice at a fair price.",
    "Carefully packed and shipped in recyclable packaging.",
    "Backed by our friendly customer support team.",
    "Thousands of customers reorder it every month.",
    "A thoughtful gift for friends and family.",
]
_REVIEW_GOOD = ["Exactly as described", "Great value", "Love it", "Would buy again", "Works perfectly"]
_REVIEW_BAD = ["Not what I expected", "Runs small", "Arrived late", "Okay for the price", "Could be better"]

# an option value's phrase inside an instruction
_OPTION_PHRASES = {
    "color": "in {v} color",
    "size": "in size {v}",
    "flavor name": "with {v} flavor",
    "scent": "with {v} scent",
    "style": "in the {v} style",
    "pattern name": "with {v} pattern",
}
_PREFIXES = ["i need", "i am looking for", "i want to buy", "find me", "i'm searching for", "can you get me"]


def _brands(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add((rng.choice(_SYL_A) + rng.choice(_SYL_B) + rng.choice(["", "a", "o", "ix"])).capitalize())
    return sorted(names)


def _asin(rng: random.Random, used: set[str]) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    while True:
        a = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if a not in used:
            used.add(a)
            return a


def _title_case(text: str) -> str:
    return " ".join(w if any(c.isdigit() for c in w) else w[:1].upper() + w[1:] for w in text.split())


def _make_product(rng: random.Random, t: ProductType, category: str, brand: str, asin: str) -> dict[str, Any]:
    attrs = sorted(rng.sample(t.attributes, rng.randint(3, min(5, len(t.attributes)))), key=t.attributes.index)
    options: dict[str, list[str]] = {}
    for oname, pool in t.options.items():
        k = rng.randint(min(2, len(pool)), min(6, len(pool)))
        options[oname] = sorted(rng.sample(pool, k), key=pool.index)
    lo, hi = t.price
    p = round(rng.uniform(lo, hi), 2)
    pricing = [p] if rng.random() < 0.8 else [p, round(p * rng.uniform(1.1, 1.4), 2)]
    shown = rng.sample(attrs, rng.randint(1, 2))
    aud = (t.audience + " ") if t.audience else ""
    title = f"{brand} {aud}{' '.join(shown)} {t.name}"
    if rng.random() < 0.5:
        title += f" - {rng.choice(_ADJ)} {t.name.split()[-1]}"
    title = _title_case(title)
    feats = [f"{_title_case(a)}: this {t.name} is {a}." for a in attrs]
    if options:
        feats.append("Available in " + "; ".join(f"{k}: {', '.join(v)}" for k, v in options.items()) + ".")
    desc = f"{title}. This {aud}{t.name} from {brand} is {', '.join(attrs[:-1])} and {attrs[-1]}. " + " ".join(
        rng.sample(_FILLER, 2)
    )
    reviews = []
    for _ in range(rng.randint(1, 3)):
        good = rng.random() < 0.7
        score = rng.randint(4, 5) if good else rng.randint(1, 3)
        head = rng.choice(_REVIEW_GOOD if good else _REVIEW_BAD)
        reviews.append({"title": head, "body": f"{head.lower()}; the {t.name} is {rng.choice(attrs)}.", "score": score})
    rating = round(sum(r["score"] for r in reviews) / len(reviews), 1)
    return {
        "asin": asin,
        "name": title,
        "Title": title,
        "category": category,
        "query": t.query,
        "product_category": t.path,
        "Description": desc,
        "BulletPoints": feats,
        "Reviews": reviews,
        "Rating": rating,
        "pricing": pricing,
        "Price": price_tag(pricing),
        "options": options,
        "Attributes": attrs,
        "type": t.name,
        "audience": t.audience,
    }


def price_tag(pricing: list[float]) -> str:
    return f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}"


def generate_product_prices(products: list[dict[str, Any]], seed: int) -> dict[str, float]:
    """The original's fixed per-product price: the single price, or uniform inside a price range."""
    rng = random.Random(seed)
    prices = {}
    for p in products:
        pricing = p.get("pricing") or []
        if not pricing:
            price = 100.0
        elif len(pricing) == 1:
            price = float(pricing[0])
        else:
            price = rng.uniform(float(pricing[0]), float(pricing[1]))
        prices[p["asin"]] = price
    return prices


def price_bound(rng: random.Random, price: float) -> tuple[float, str]:
    """The original bound: the larger of two draws from the next four multiples of 10 above the price."""
    price_range = [p for p in PRICE_RANGE if p > price][:4]
    if len(price_range) >= 2:
        _, upper = sorted(rng.sample(price_range, 2))
        return upper, f", and price lower than {upper:.2f} dollars"
    return 1000000.0, ""


def _instruction(rng: random.Random, product: dict[str, Any], attrs: list[str], opts: dict[str, str]) -> str:
    noun = ((product["audience"] + " ") if product["audience"] else "") + product["type"]
    plural = product["type"].endswith("s")
    attr_text = " and ".join(attrs)
    if rng.random() < 0.5:
        art = "some" if plural else ("an" if attr_text[0] in "aeiou" else "a")
        body = f"{rng.choice(_PREFIXES)} {art} {attr_text} {noun}"
    else:
        art = "some" if plural else ("an" if noun[0] in "aeiou" else "a")
        body = f"{rng.choice(_PREFIXES)} {art} {noun} that {'are' if plural else 'is'} {attr_text}"
    phrases = [_OPTION_PHRASES.get(k, k + " {v}").format(v=v) for k, v in opts.items()]
    if phrases:
        body += " " + " and ".join(phrases)
    return body


def generate_catalogue(
    seed: int = 0, n_products: int = DEFAULT_N_PRODUCTS, n_goals: int = DEFAULT_N_GOALS
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """Products, goals and fixed prices of the offline catalogue; a pure function of the arguments."""
    if n_products < 40:
        raise ValueError(f"n_products: need at least 40 (one per product type), got {n_products}")
    if n_goals < 1:
        raise ValueError(f"n_goals: must be >= 1, got {n_goals}")
    rng = random.Random(f"{CATALOGUE_VERSION}:{seed}")
    brands = _brands(rng, 80)
    types = [(cat, t) for cat, ts in PRODUCT_TYPES.items() for t in ts]
    used: set[str] = set()
    products = []
    for i in range(n_products):
        cat, t = types[i % len(types)]
        products.append(_make_product(rng, t, cat, rng.choice(brands), _asin(rng, used)))
    rng.shuffle(products)
    prices = generate_product_prices(products, seed)
    goals = []
    order = list(range(len(products)))
    rng.shuffle(order)
    for j in range(n_goals):
        p = products[order[j % len(order)]]
        attrs = rng.sample(p["Attributes"], rng.randint(1, min(3, len(p["Attributes"]))))
        opts = {k: rng.choice(v) for k, v in p["options"].items() if rng.random() < 0.8}
        if p["options"] and not opts:
            k = rng.choice(sorted(p["options"]))
            opts = {k: rng.choice(p["options"][k])}
        upper, price_text = price_bound(rng, prices[p["asin"]])
        goals.append(
            {
                "asin": p["asin"],
                "category": p["category"],
                "query": p["query"],
                "name": p["name"],
                "product_category": p["product_category"],
                "instruction_text": _instruction(rng, p, attrs, opts) + price_text,
                "attributes": attrs,
                "goal_options": list(opts.values()),
                "price_upper": upper,
                "weight": 1,
            }
        )
    return products, goals, prices
