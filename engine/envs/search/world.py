"""The fictional world of Search-QA's generated knowledge base (engine/envs/search/data.py ``generate_kb``).

Countries, cities, people, companies and creative works with invented names (syllables drawn at random, unique over
the whole world), dates and attributes, so that a pretrained model cannot know any answer. Every draw comes from the
one ``random.Random`` it is handed, in a fixed order: the world is a function of that generator's state.
"""

from __future__ import annotations

import random
from typing import Any

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "st", "th", "qu"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "x"]
_OCCUPATIONS = [
    "cartographer", "violinist", "architect", "botanist", "chemist", "novelist", "sculptor", "astronomer",
    "economist", "film director", "photographer", "engineer", "historian", "glassblower", "linguist", "painter",
]  # fmt: skip
_INDUSTRIES = [
    ("Optics", "optical instruments"), ("Foods", "packaged food"), ("Shipping", "freight shipping"),
    ("Textiles", "textiles"), ("Pharma", "pharmaceuticals"), ("Motors", "electric vehicles"),
    ("Press", "book publishing"), ("Robotics", "industrial robots"), ("Airways", "regional air travel"),
    ("Mining", "copper mining"),
]  # fmt: skip
_WORK_KINDS = [
    ("novel", "written by", "author"),
    ("film", "directed by", "director"),
    ("album", "recorded by", "artist"),
]
_GENRES = ["mystery", "science fiction", "folk", "historical drama", "comedy", "jazz", "thriller", "romance"]
_ADJ = ["Glass", "Silent", "Amber", "Hollow", "Crimson", "Distant", "Paper", "Winter", "Copper", "Velvet", "Iron"]
_NOUN = ["Orchard", "Lantern", "Harbor", "Garden", "Compass", "Meridian", "Tide", "Archive", "Staircase", "Mirror"]
_REGIONS = ["the northern coast", "the central plateau", "the eastern lowlands", "the southern archipelago"]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return w.capitalize()


def _unique(rng: random.Random, used: set[str], make) -> str:  # noqa: ANN001
    for _ in range(10000):
        name = make()
        if name.lower() not in used:
            used.add(name.lower())
            return name
    raise RuntimeError("could not draw a unique name")  # pragma: no cover


def draw_world(rng: random.Random, n_people: int, n_cities: int, n_orgs: int, n_works: int) -> dict[str, Any]:
    """Countries, cities, people, companies and works of the knowledge base, drawn from ``rng`` in this order (the
    names unique over all of them)."""
    used: set[str] = set()
    countries, cities = _draw_places(rng, used, n_cities)
    people, orgs = _draw_people_and_orgs(rng, used, cities, n_people, n_orgs)
    works = _draw_works(rng, used, people, n_works)
    return {"countries": countries, "cities": cities, "people": people, "orgs": orgs, "works": works}


def _draw_places(rng: random.Random, used: set[str], n_cities: int) -> tuple[list[dict], list[dict]]:
    """Countries (one per 6 cities, at least 4) and ``n_cities`` cities, spread over the countries in turn; each
    country's capital is its first city."""
    countries = []
    for _ in range(max(4, n_cities // 6)):
        cname = _unique(rng, used, lambda: _word(rng, 2) + rng.choice(["ia", "land", "ora", "istan", ""]))
        countries.append(
            {
                "name": cname,
                "adj": cname + ("n" if cname[-1] in "aeiou" else "ish"),
                "currency": _unique(rng, used, lambda: _word(rng, 1).lower()),
                "region": rng.choice(_REGIONS),
            }
        )
    cities = []
    for i in range(n_cities):
        country = countries[i % len(countries)]
        cities.append(
            {
                "name": _unique(
                    rng, used, lambda: rng.choice(["", "Port ", "New ", ""]) + _word(rng, rng.randint(2, 3))
                ),
                "country": country["name"],
                "founded": rng.randint(1100, 1850),
                "river": _unique(rng, used, lambda: _word(rng, 2) + " River"),
                "population": rng.randint(20, 900) * 1000,
            }
        )
    for c in countries:
        c["capital"] = next(x["name"] for x in cities if x["country"] == c["name"])
    return countries, cities


def _draw_people_and_orgs(
    rng: random.Random, used: set[str], cities: list[dict], n_people: int, n_orgs: int
) -> tuple[list[dict], list[dict]]:
    """``n_people`` people living in the cities and ``n_orgs`` companies, each founded by one of them (the ten
    industries in turn); then every person's employer among the companies."""
    people = []
    for _ in range(n_people):
        people.append(
            {
                "name": _unique(rng, used, lambda: f"{_word(rng, 2)} {_word(rng, rng.randint(2, 3))}"),
                "born": rng.randint(1890, 1995),
                "city": rng.choice(cities)["name"],
                "occupation": rng.choice(_OCCUPATIONS),
                "gender": rng.choice(["he", "she"]),
            }
        )
    orgs = []
    for i in range(n_orgs):
        suffix, industry = _INDUSTRIES[i % len(_INDUSTRIES)]
        founder = rng.choice(people)
        orgs.append(
            {
                "name": _unique(rng, used, lambda s=suffix: f"{_word(rng, 2)} {s}"),
                "industry": industry,
                "founded": rng.randint(max(founder["born"] + 20, 1900), 2020),
                "city": rng.choice(cities)["name"],
                "founder": founder["name"],
            }
        )
    for p in people:
        p["employer"] = rng.choice(orgs)["name"]
    return people, orgs


def _draw_works(rng: random.Random, used: set[str], people: list[dict], n_works: int) -> list[dict]:
    """``n_works`` novels, films and albums, each by one of the people, after the creator turned 18."""
    works = []
    for _ in range(n_works):
        kind, verb, role = rng.choice(_WORK_KINDS)
        creator = rng.choice(people)
        works.append(
            {
                "title": _unique(
                    rng,
                    used,
                    lambda: (
                        f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
                        + rng.choice(["", f" of {_word(rng, 2)}", " II", f" in {_word(rng, 2)}"])
                    ),
                ),
                "kind": kind,
                "verb": verb,
                "role": role,
                "creator": creator["name"],
                "year": rng.randint(creator["born"] + 18, 2023),
                "genre": rng.choice(_GENRES),
            }
        )
    return works
