"""WebShop data: the generated offline catalogue and goal set, and the adapter for the original WebShop files.

Both produce the same normalised layout, the one the original engine builds in ``load_products`` /
``get_human_goals`` (so ``webshop.py`` and its reward work on either):

product: ``asin, name, Title, category, query, product_category ("A › B › C"), Description,
BulletPoints (list), Reviews (list of {title, body, score}), Rating, pricing (1 or 2 floats), Price (tag),
options ({option name: [lower-cased values]}), Attributes (list)``.

goal: ``asin, category, query, name, product_category, instruction_text, attributes, goal_options
(list of option values), price_upper, weight``.

Generated catalogue (``generate_catalogue``): the original's five categories (beauty, electronics, fashion,
food, furniture), 8 product types each, with fictional brands. Each product of a type gets a random subset of
the type's attribute pool and of each option pool, so products of one type differ in exactly the things an
instruction asks for, and a search returns many near misses. Goals pick a product, 1-3 of its attributes, one
value of most of its options, and a price bound drawn as the original does (two of the next four multiples of
10 above the price, the larger one). Everything is a function of the seed.

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
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.corpus_index import Bm25Index

CATALOGUE_VERSION = "webshop-gen-v1"
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # the original's price bounds
DEFAULT_N_PRODUCTS = 2400
DEFAULT_N_GOALS = 2000
MAX_TEST_GOALS = 500  # the original holds out goals[0:500] as the test split
INDEX_LAYOUT = "doc2"  # bump when search_text changes (the on-disk index is keyed by it)

# ------------------------------------------------------------------------------------------ vocabulary

COLORS = [
    "black", "white", "navy", "red", "olive", "khaki", "burgundy", "pink", "beige", "charcoal", "teal",
    "mustard", "lavender", "coral", "brown", "silver",
]  # fmt: skip
CLOTH_SIZES = ["x-small", "small", "medium", "large", "x-large", "xx-large", "3x-large"]
SHOE_SIZES = ["6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12"]
WAIST_SIZES = ["28w x 30l", "30w x 30l", "30w x 32l", "32w x 32l", "34w x 32l", "36w x 34l", "38w x 34l"]
PACKS = ["pack of 1", "pack of 2", "pack of 3", "pack of 6", "pack of 12"]
COUNTS = ["20 count", "40 count", "60 count", "100 count"]
OUNCES = ["8 ounce", "12 ounce", "16 ounce", "1.5 pound", "2 pound", "32 ounce"]
FLUID = ["8.4 fl oz", "12 fl oz", "16.9 fl oz", "33.8 fl oz"]


@dataclass(frozen=True)
class ProductType:
    name: str  # the type phrase used in titles and instructions ("t-shirt")
    audience: str  # "men's", "women's" or ""
    query: str  # the search query the product was "scraped" under (type match)
    path: str  # product_category, "A › B › C"
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    price: tuple[float, float] = (10.0, 60.0)


def _t(name, audience, query, path, attrs, options, price):  # noqa: ANN001, ANN202 - table helper
    return ProductType(name, audience, query, path, tuple(attrs), {k: tuple(v) for k, v in options.items()}, price)


_FASHION = "Clothing, Shoes & Jewelry"
_FOOD = "Grocery & Gourmet Food"
_BEAUTY = "Beauty & Personal Care"
_ELEC = "Electronics"
_HOME = "Home & Kitchen"

PRODUCT_TYPES: dict[str, list[ProductType]] = {
    "fashion": [
        _t("t-shirt", "men's", "men's t-shirts", f"{_FASHION} › Men › Clothing › Shirts › T-Shirts",
           ["machine washable", "short sleeve", "cotton", "slim fit", "moisture wicking", "crew neck", "tagless"],
           {"color": COLORS, "size": CLOTH_SIZES}, (8, 35)),
        _t("dress", "women's", "women's dresses", f"{_FASHION} › Women › Clothing › Dresses",
           ["long sleeve", "v-neck", "polyester", "elastic waist", "midi length", "floral print", "hand wash"],
           {"color": COLORS, "size": CLOTH_SIZES}, (18, 70)),
        _t("jeans", "men's", "men's jeans", f"{_FASHION} › Men › Clothing › Jeans",
           ["straight leg", "stretch", "relaxed fit", "button closure", "denim", "machine wash", "five pocket"],
           {"color": ["light wash", "dark wash", "black", "stonewash", "indigo", "grey"], "size": WAIST_SIZES},
           (20, 80)),
        _t("hoodie", "women's", "women's hoodies", f"{_FASHION} › Women › Clothing › Fashion Hoodies",
           ["fleece lined", "drawstring", "kangaroo pocket", "oversized", "pullover", "zip up", "soft fabric"],
           {"color": COLORS, "size": CLOTH_SIZES}, (15, 55)),
        _t("running shoes", "men's", "men's running shoes", f"{_FASHION} › Men › Shoes › Athletic › Running",
           ["rubber sole", "lace up", "non slip", "breathable mesh", "lightweight", "memory foam", "arch support"],
           {"color": COLORS, "size": SHOE_SIZES}, (30, 120)),
        _t("sandals", "women's", "women's sandals", f"{_FASHION} › Women › Shoes › Sandals",
           ["open toe", "ankle strap", "cushioned footbed", "flat", "faux leather", "adjustable buckle", "wedge"],
           {"color": COLORS, "size": SHOE_SIZES}, (15, 60)),
        _t("socks", "", "athletic socks", f"{_FASHION} › Men › Clothing › Socks & Hosiery › Athletic Socks",
           ["cushioned", "ankle length", "anti blister", "quick dry", "arch compression", "cotton blend"],
           {"color": COLORS, "size": ["small", "medium", "large"], "style": PACKS}, (8, 30)),
        _t("rain jacket", "women's", "women's rain jackets", f"{_FASHION} › Women › Clothing › Coats & Jackets",
           ["waterproof", "hooded", "packable", "windproof", "zipper pockets", "lightweight shell", "sealed seams"],
           {"color": COLORS, "size": CLOTH_SIZES}, (25, 110)),
    ],
    "food": [
        _t("green tea", "", "green tea bags", f"{_FOOD} › Beverages › Tea › Green",
           ["organic", "gluten free", "non gmo", "individually wrapped", "kosher", "caffeine free", "fair trade"],
           {"flavor name": ["jasmine", "mint", "lemon", "honey ginger", "original", "matcha"], "size": COUNTS},
           (5, 25)),
        _t("coffee beans", "", "whole bean coffee", f"{_FOOD} › Beverages › Coffee › Whole Coffee Beans",
           ["dark roast", "medium roast", "single origin", "arabica", "organic", "fair trade", "low acid"],
           {"flavor name": ["colombian", "french roast", "hazelnut", "vanilla", "espresso", "breakfast blend"],
            "size": OUNCES}, (9, 45)),
        _t("protein bars", "", "protein bars", f"{_FOOD} › Snack Foods › Bars › Protein Bars",
           ["high protein", "low sugar", "gluten free", "keto friendly", "plant based", "soy free", "non gmo"],
           {"flavor name": ["chocolate chip", "peanut butter", "cookie dough", "birthday cake", "almond", "lemon"],
            "size": ["12 count", "15 count", "18 count", "24 count"]}, (12, 40)),
        _t("beef jerky", "", "beef jerky", f"{_FOOD} › Meat & Seafood › Jerky & Dried Meats",
           ["high protein", "low fat", "gluten free", "no preservatives", "grass fed", "resealable bag"],
           {"flavor name": ["original", "teriyaki", "peppered", "sweet and spicy", "hickory smoked"],
            "size": ["2.5 ounce", "3.25 ounce", "8 ounce", "10 ounce"]}, (6, 35)),
        _t("gummy candy", "", "gummy candy", f"{_FOOD} › Snack Foods › Candy & Chocolate › Gummy Candy",
           ["fat free", "vegan", "gelatin free", "individually wrapped", "kosher", "natural flavors"],
           {"flavor name": ["sour", "cherry", "tropical", "watermelon", "assorted fruit", "peach"], "size": PACKS},
           (4, 25)),
        _t("olive oil", "", "extra virgin olive oil", f"{_FOOD} › Pantry Staples › Cooking Oils › Olive",
           ["extra virgin", "cold pressed", "first harvest", "organic", "non gmo", "glass bottle"],
           {"size": FLUID, "style": ["single bottle", "pack of 2", "tin can"]}, (8, 45)),
        _t("pasta sauce", "", "pasta sauce jar", f"{_FOOD} › Pantry Staples › Sauces › Pasta Sauces",
           ["no sugar added", "vegan", "low sodium", "gluten free", "slow cooked", "imported"],
           {"flavor name": ["marinara", "tomato basil", "arrabbiata", "vodka", "roasted garlic"],
            "size": ["24 ounce", "25 ounce", "32 ounce"]}, (4, 20)),
        _t("trail mix", "", "trail mix snack", f"{_FOOD} › Snack Foods › Trail Mix",
           ["resealable bag", "no artificial colors", "high fiber", "gluten free", "kosher", "roasted nuts"],
           {"flavor name": ["mountain mix", "sweet and salty", "tropical", "dark chocolate", "cranberry almond"],
            "size": OUNCES}, (6, 30)),
    ],
    "beauty": [
        _t("shampoo", "", "sulfate free shampoo", f"{_BEAUTY} › Hair Care › Shampoo & Conditioner › Shampoos",
           ["sulfate free", "paraben free", "color safe", "cruelty free", "argan oil", "for dry hair", "vegan"],
           {"size": FLUID, "scent": ["coconut", "lavender", "tea tree", "unscented", "citrus", "rosemary mint"]},
           (6, 35)),
        _t("face moisturizer", "", "face moisturizer", f"{_BEAUTY} › Skin Care › Face › Moisturizers",
           ["hyaluronic acid", "oil free", "spf 30", "fragrance free", "for sensitive skin", "non comedogenic"],
           {"size": ["1 fl oz", "1.7 fl oz", "2.5 fl oz", "3.4 fl oz"]}, (9, 60)),
        _t("lipstick", "", "matte lipstick", f"{_BEAUTY} › Makeup › Lips › Lipstick",
           ["long lasting", "matte finish", "cruelty free", "moisturizing", "waterproof", "paraben free"],
           {"color": ["ruby red", "nude", "berry", "coral", "mauve", "plum", "rose"]}, (5, 30)),
        _t("nail polish", "", "nail polish", f"{_BEAUTY} › Foot, Hand & Nail Care › Nail Polish",
           ["quick dry", "chip resistant", "non toxic", "gel finish", "vegan", "high shine"],
           {"color": COLORS, "size": ["0.5 fl oz", "pack of 2", "pack of 6"]}, (4, 22)),
        _t("hair dryer", "", "ionic hair dryer", f"{_BEAUTY} › Hair Care › Styling Tools › Hair Dryers",
           ["ionic", "ceramic", "diffuser included", "cool shot button", "lightweight", "foldable handle"],
           {"color": ["black", "white", "pink", "rose gold", "purple"], "style": ["1875 watt", "1600 watt"]},
           (20, 90)),
        _t("deodorant", "", "natural deodorant", f"{_BEAUTY} › Personal Care › Deodorants & Antiperspirants",
           ["aluminum free", "baking soda free", "long lasting", "travel size", "vegan", "for sensitive skin"],
           {"scent": ["lavender", "cedarwood", "citrus", "unscented", "eucalyptus", "vanilla"], "size": PACKS},
           (5, 25)),
        _t("body wash", "", "moisturizing body wash", f"{_BEAUTY} › Personal Care › Body › Body Washes",
           ["moisturizing", "sulfate free", "natural ingredients", "dermatologist tested", "shea butter"],
           {"scent": ["coconut", "lavender", "oatmeal", "cucumber", "unscented", "citrus"], "size": FLUID},
           (5, 25)),
        _t("eyeshadow palette", "", "eyeshadow palette", f"{_BEAUTY} › Makeup › Eyes › Eyeshadow",
           ["highly pigmented", "long lasting", "cruelty free", "blendable", "shimmer and matte", "travel size"],
           {"color": ["nude", "smoky", "sunset", "rose gold", "neutral", "jewel tones"]}, (8, 45)),
    ],
    "electronics": [
        _t("wireless earbuds", "", "wireless earbuds", f"{_ELEC} › Headphones, Earbuds & Accessories › Earbuds",
           ["noise cancelling", "bluetooth 5.3", "water resistant", "charging case", "touch control", "deep bass"],
           {"color": ["black", "white", "navy", "pink", "silver"]}, (20, 150)),
        _t("phone case", "", "iphone case", f"{_ELEC} › Cell Phones & Accessories › Cases, Holsters & Sleeves",
           ["shockproof", "slim", "clear back", "wireless charging compatible", "kickstand", "raised edges"],
           {"color": COLORS, "size": ["iphone 13", "iphone 14", "iphone 15", "iphone 15 pro", "iphone 15 plus"]},
           (8, 35)),
        _t("usb c cable", "", "usb c charging cable", f"{_ELEC} › Computers & Accessories › Cables › USB Cables",
           ["fast charging", "braided nylon", "data transfer", "durable", "tangle free", "usb 3.1"],
           {"size": ["3 ft", "6 ft", "10 ft"], "style": PACKS}, (6, 25)),
        _t("bluetooth speaker", "", "portable bluetooth speaker", f"{_ELEC} › Portable Audio & Video › Speakers",
           ["waterproof", "portable", "long battery life", "stereo pairing", "built in microphone", "rugged"],
           {"color": ["black", "navy", "red", "teal", "grey", "camo"]}, (20, 120)),
        _t("hdmi cable", "", "4k hdmi cable", f"{_ELEC} › Television & Video › Accessories › Cables › HDMI Cables",
           ["4k", "high speed", "gold plated", "ethernet", "braided", "hdr support"],
           {"size": ["3 ft", "6 ft", "10 ft", "15 ft", "25 ft"], "style": PACKS}, (6, 30)),
        _t("power bank", "", "portable power bank", f"{_ELEC} › Cell Phones & Accessories › Chargers & Power Adapters",
           ["fast charging", "usb c", "led display", "compact", "dual output", "airline safe"],
           {"size": ["5000mah", "10000mah", "20000mah", "26800mah"], "color": ["black", "white", "blue"]},
           (15, 70)),
        _t("wireless mouse", "", "wireless mouse", f"{_ELEC} › Computers & Accessories › Mice",
           ["ergonomic", "silent click", "rechargeable", "adjustable dpi", "usb receiver", "bluetooth"],
           {"color": ["black", "white", "grey", "pink", "blue"]}, (8, 45)),
        _t("desk lamp", "", "led desk lamp", f"{_HOME} › Lighting › Lamps & Shades › Desk Lamps",
           ["dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm", "energy efficient"],
           {"color": ["black", "white", "silver", "wood grain"]}, (15, 60)),
    ],
    "furniture": [
        _t("office chair", "", "ergonomic office chair", f"{_HOME} › Furniture › Home Office Furniture › Chairs",
           ["lumbar support", "adjustable height", "mesh back", "swivel", "padded armrests", "easy assembly"],
           {"color": ["black", "grey", "white", "navy", "brown"]}, (60, 300)),
        _t("bookshelf", "", "wooden bookshelf", f"{_HOME} › Furniture › Living Room Furniture › Bookcases",
           ["solid wood", "easy assembly", "adjustable shelves", "anti tip", "storage space", "industrial style"],
           {"color": ["walnut", "white", "black", "oak", "espresso"], "size": ["3 tier", "4 tier", "5 tier"]},
           (35, 200)),
        _t("coffee table", "", "coffee table", f"{_HOME} › Furniture › Living Room Furniture › Tables",
           ["storage shelf", "tempered glass", "solid wood", "lift top", "mid century", "easy assembly"],
           {"color": ["walnut", "white", "black", "oak", "grey"]}, (50, 250)),
        _t("bed frame", "", "metal bed frame", f"{_HOME} › Furniture › Bedroom Furniture › Beds & Frames",
           ["no box spring needed", "under bed storage", "noise free", "heavy duty", "upholstered", "headboard"],
           {"size": ["twin", "full", "queen", "king"], "color": ["black", "grey", "white", "brown"]}, (80, 400)),
        _t("nightstand", "", "nightstand with drawer", f"{_HOME} › Furniture › Bedroom Furniture › Nightstands",
           ["with drawer", "open shelf", "charging station", "solid wood", "easy assembly", "modern design"],
           {"color": ["walnut", "white", "black", "oak", "grey"], "style": ["set of 1", "set of 2"]}, (30, 150)),
        _t("throw pillow covers", "", "throw pillow covers", f"{_HOME} › Home Décor › Decorative Pillows",
           ["hidden zipper", "machine washable", "velvet", "double sided", "linen blend", "soft"],
           {"color": COLORS, "size": ["16x16 inch", "18x18 inch", "20x20 inch"]}, (8, 35)),
        _t("shower curtain", "", "fabric shower curtain", f"{_HOME} › Bath › Shower Curtains & Accessories",
           ["waterproof", "machine washable", "weighted hem", "hooks included", "mildew resistant", "waffle weave"],
           {"color": COLORS, "size": ["72x72 inch", "72x84 inch", "36x72 inch"]}, (10, 40)),
        _t("area rug", "", "area rug", f"{_HOME} › Home Décor › Rugs, Pads & Protectors › Area Rugs",
           ["non slip", "machine washable", "low pile", "stain resistant", "shag", "indoor outdoor"],
           {"color": COLORS, "size": ["3x5 feet", "4x6 feet", "5x7 feet", "8x10 feet"]}, (25, 220)),
    ],
}  # fmt: skip

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
        "Price": _price_tag(pricing),
        "options": options,
        "Attributes": attrs,
        "type": t.name,
        "audience": t.audience,
    }


def _price_tag(pricing: list[float]) -> str:
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


def _price_bound(rng: random.Random, price: float) -> tuple[float, str]:
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
        upper, price_text = _price_bound(rng, prices[p["asin"]])
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
            "Price": _price_tag(pricing),
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
    if not products:
        raise ValueError(f"products_path: no usable products in {products_path}")
    prices = generate_product_prices(products, seed)
    rng = random.Random(seed)
    goals: list[dict[str, Any]] = []
    for p in products:
        base = {k: p[k] for k in ("asin", "category", "query", "product_category")} | {"name": p["Title"]}
        if human is not None:
            for ins in p.get("instructions", []):
                attrs = ins.get("instruction_attributes") or []
                if not attrs:
                    continue
                upper, price_text = _price_bound(rng, prices[p["asin"]])
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
            upper, price_text = _price_bound(rng, prices[p["asin"]])
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
    if not goals:
        raise ValueError("goals: the given files yield no goal (no instruction with attributes)")
    return products, goals, prices


def write_original_layout(
    products: list[dict[str, Any]], goals: list[dict[str, Any]], out_dir: str | os.PathLike[str]
) -> dict[str, str]:
    """Write products and goals in the original WebShop file layout (``items_shuffle.json``,
    ``items_ins_v2.json``, ``items_human_ins.json``), so the generated catalogue can be read back by
    ``load_original`` or served by the upstream WebShop. Price bounds are re-drawn on reading, as upstream."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items, attrs, human = [], {}, {}
    for p in products:
        pricing = "".join(f"${x}" for x in p["pricing"])
        options = {k: [{"value": v, "image": None} for v in vals] for k, vals in p["options"].items()}
        items.append({"asin": p["asin"], "name": p["Title"], "full_description": p["Description"],
                      "small_description": list(p["BulletPoints"]), "pricing": pricing,
                      "customization_options": options or None, "category": p["category"], "query": p["query"],
                      "product_category": p["product_category"], "images": [""]})  # fmt: skip
        attrs[p["asin"]] = {"attributes": list(p["Attributes"])}
    for g in goals:
        text = re.sub(r", and price lower than [0-9.]+ dollars$", "", g["instruction_text"])
        human.setdefault(g["asin"], []).append({"asin": g["asin"], "instruction": text,
                                                "instruction_attributes": list(g["attributes"]),
                                                "instruction_options": list(g["goal_options"])})  # fmt: skip
    paths = {"products": out / "items_shuffle.json", "attributes": out / "items_ins_v2.json",
             "human_goals": out / "items_human_ins.json"}  # fmt: skip
    for key, obj in (("products", items), ("attributes", attrs), ("human_goals", human)):
        paths[key].write_text(json.dumps(obj), encoding="utf-8")
    return {k: str(v) for k, v in paths.items()}


# --------------------------------------------------------------------------------------------- catalogue


class Catalogue:
    """Products, goals, fixed prices and a BM25 search over the products (built lazily, cached on disk)."""

    def __init__(self, products: list[dict[str, Any]], goals: list[dict[str, Any]], prices: dict[str, float],
                 key: str, seed: int = 0) -> None:  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    """``python -m alignopsd.engine.envs.webshop_data --out DIR``: write the generated catalogue and goals in
    the original WebShop file layout."""
    import argparse

    ap = argparse.ArgumentParser(description="export the generated WebShop catalogue in the original layout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--products", type=int, default=DEFAULT_N_PRODUCTS)
    ap.add_argument("--goals", type=int, default=DEFAULT_N_GOALS)
    args = ap.parse_args(argv)
    products, goals, _ = generate_catalogue(args.seed, args.products, args.goals)
    for name, path in write_original_layout(products, goals, args.out).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
