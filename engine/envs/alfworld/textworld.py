"""The ALFWorld/TextWorld engine stack for one game at a time, and a faster TextWorld (same outputs).

Shared by the environment (env.py) and the game generator's expert check (gen.py).
Everything heavy (textworld, alfworld, fast-downward) is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["make_textworld_env", "memoize_textworld_parsers"]

_PATCHED = False


def memoize_textworld_parsers(enable: bool = True) -> None:
    """Speed up TextWorld's PDDL text generation (outputs are unchanged).

    TextWorld re-parses the same few dozen template strings with tatsu for every admissible command at
    every step and deep-copies the derivation context for every symbol, which is most of an ALFWorld
    step's cost; loading and resetting a game translates its PDDL problem with fast-downward four times.
    We memoize the parsers and the translation, and copy contexts one level deep (see _copy_context). Parsing
    is a pure function of the string, so we cache the parse (handing out deep copies where callers
    mutate the result). The test suite
    checks that a patched and an unpatched engine produce identical observations and commands.
    """
    global _PATCHED
    import fast_downward  # noqa: PLC0415
    import textworld.envs.pddl.textgen as tg  # noqa: PLC0415
    import textworld.logic as tl  # noqa: PLC0415

    if enable and not hasattr(fast_downward, "_alignopsd_orig_pddl2sas"):
        fast_downward._alignopsd_orig_pddl2sas = fast_downward.pddl2sas
        fast_downward.pddl2sas = _cached_pddl2sas(fast_downward.pddl2sas)
    elif not enable and hasattr(fast_downward, "_alignopsd_orig_pddl2sas"):
        fast_downward.pddl2sas = fast_downward._alignopsd_orig_pddl2sas
        del fast_downward._alignopsd_orig_pddl2sas
    if enable and not hasattr(tg, "_alignopsd_orig_copy_context"):
        tg._alignopsd_orig_copy_context = tg.copy_context
        tg.copy_context = _copy_context
    elif not enable and hasattr(tg, "_alignopsd_orig_copy_context"):
        tg.copy_context = tg._alignopsd_orig_copy_context
        del tg._alignopsd_orig_copy_context
    for mod in (tg, tl):
        orig = getattr(mod, "_alignopsd_orig_parse", None)
        if enable and orig is None:
            mod._alignopsd_orig_parse = mod._parse_and_convert
            # textgen symbols are mutated by the caller (contexts are attached): hand out copies;
            # logic objects (rules, propositions) are immutable values: share them.
            mod._parse_and_convert = _memoized(mod._parse_and_convert, copy_result=mod is tg)
        elif not enable and orig is not None:
            mod._parse_and_convert = orig
            del mod._alignopsd_orig_parse
    _PATCHED = enable


def _cached_pddl2sas(fn):
    """fast-downward's PDDL -> SAS translation, memoized (it is a pure function of its text inputs and
    its result is only read). A fresh game load plus reset translates the same problem four times."""
    import functools  # noqa: PLC0415

    @functools.lru_cache(maxsize=32)
    def cached(domain: str, problem: str, verbose: bool, optimize: bool):
        return fn(domain, problem, verbose=verbose, optimize=optimize)

    def pddl2sas(domain, problem, verbose=False, optimize=False):
        return cached(domain, problem, bool(verbose), bool(optimize))

    return pddl2sas


def _copy_context(context):
    """TextWorld's copy_context without deep-copying entity infos and variables: derivations only
    rebind names in these dicts (``dict.update``) and never mutate the values, so copying the dicts
    is enough. This was 80% of a step's time."""
    return {
        "state": context["state"],
        "facts": context["facts"],
        "variables": dict(context["variables"]),
        "mapping": dict(context["mapping"]),
        "entity_infos": context["entity_infos"],
    }


def _memoized(fn, copy_result: bool):
    import copy  # noqa: PLC0415

    cache: dict = {}

    def parse(*args, **kwargs):
        if kwargs.get("trace"):
            return fn(*args, **kwargs)
        try:
            key = (args, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:
            return fn(*args, **kwargs)
        if key not in cache:
            cache[key] = fn(*args, **kwargs)
        return copy.deepcopy(cache[key]) if copy_result else cache[key]

    return parse


def make_textworld_env(expert: bool = False, fast: bool = True):
    """alfworld's text environment stack for one game at a time (load(gamefile) then reset()).

    ``fast`` memoizes TextWorld's template parsers (:func:`memoize_textworld_parsers`).
    """
    import textworld  # noqa: PLC0415
    from alfworld.agents.environment.alfred_tw_env import (  # noqa: PLC0415
        AlfredDemangler,
        AlfredExpert,
        AlfredExpertType,
        AlfredInfos,
    )
    from textworld.envs.pddl import PddlEnv  # noqa: PLC0415

    if fast and not _PATCHED:
        memoize_textworld_parsers(True)
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    if expert:
        infos.extras.append("expert_plan")
    env: Any = PddlEnv(infos)
    wrappers: list[Any] = [AlfredDemangler(shuffle=False), AlfredInfos]
    if expert:
        wrappers.append(AlfredExpert(AlfredExpertType.HANDCODED))
    for w in wrappers:
        env = w(env)
    return env
