"""Response parsing: ALGORITHM.md §1.5 and §6 case 3, plus the manager's strict validity."""

from __future__ import annotations

import random
import re
import time

import pytest
from alignopsd.engine.envs.parsing import check_response, parse_action, parse_response, parse_thinking
from hypothesis import given, settings
from hypothesis import strategies as st


def test_case3_exact():
    text = "<think> inspect state </think><action>go north</action>"
    assert parse_thinking(text) == ("inspect state", True)
    assert parse_action(text)[:2] == ("go north", True)
    assert parse_action("<search>query</search>")[:2] == ("query", True)
    assert parse_action("<answer>Paris</answer>")[:2] == ("Paris", True)
    assert parse_thinking("<think>not closed") == ("", False)


def test_thinking_rules():
    assert parse_thinking("<THINK a=1>\n multi\nline \n</Think> x") == ("multi\nline", True)
    assert parse_thinking("<think>first</think><think>second</think>") == ("first", True)
    assert parse_thinking("<think>   </think>") == ("", False)
    assert parse_thinking("no tags") == ("", False)


def test_action_order_is_by_tag_type_not_position():
    text = "<answer>late</answer> <action>early</action>"
    assert parse_action(text) == ("early", True, "action")
    assert parse_action("<answer>a</answer><search>s</search>") == ("s", True, "search")
    assert parse_action("<action>one</action><action>two</action>")[:2] == ("one", True)
    assert parse_action("<action>   </action>") == ("", False, "action")
    assert parse_action("nothing") == ("", False, None)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("go to cabinet 1", "no_think"),
        ("<think>ok</think> go to cabinet 1", "no_action"),
        ("<think>ok</think><action>go to a</action><action>go to b</action>", "multiple_actions"),
        ("<think>ok</think><action>go to a</action><answer>x</answer>", "tag_answer_not_allowed"),
        ("<think>ok</think><action>go to a</action><answer>x</answer></answer>", "unbalanced_answer"),
        ("<think>ok</think><action>   </action>", "empty_action"),
        ("<think>ok</think><action>go <action>x</action></action>", "multiple_actions"),
        ("<think>好的</think><action>go to cabinet 1</action>", "cjk"),
        ("<think>ok</think><action>打开冰箱</action>", "cjk"),
        ("<think>ok</think><action>go to a", "unbalanced_action"),
        ("<think>ok</think><search>q</search>", "tag_search_not_allowed"),
    ],
)
def test_strict_rejections(text, reason):
    ok, why = check_response(text)
    assert not ok and why == reason
    p = parse_response(text, ("action",))
    assert not p.well_formed and p.reason == reason


def test_strict_accepts_and_upper_case_tags():
    assert check_response("<think>plan</think>\n<action> go to cabinet 1 </action>") == (True, "")
    p = parse_response("<think>plan</think><ACTION>Take Apple 1 From Countertop 1</ACTION>", ("action",))
    assert p.well_formed and p.action == "Take Apple 1 From Countertop 1" and p.tag == "action"
    p = parse_response("<think>q</think><search> who </search>", ("search", "answer"))
    assert p.well_formed and (p.action, p.tag) == ("who", "search")
    assert check_response("<action>x</action>", require_think=False) == (True, "")


def test_non_string_raises_value_error():
    with pytest.raises(ValueError, match="text"):
        parse_thinking(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tags"):
        parse_action("x", ("bogus",))


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/actionthinksearchanswer 中\n")), max_size=80))
def test_never_raises_on_any_text(text):
    p = parse_response(text)
    assert isinstance(p.well_formed, bool)
    if p.well_formed:
        assert p.action and p.action == p.action.strip()


# -- the linear scanner against the regular expressions it replaces ------------------------------------------

_ACTION = ("action", "search", "answer")
_THINK_RE = re.compile(r"<think\b[^>]*>(.*?)</think\s*>", re.IGNORECASE | re.DOTALL)
_TAG_RE = {t: re.compile(rf"<{t}>(.*?)</{t}>", re.DOTALL) for t in _ACTION}
_TAG_RE_CI = {t: re.compile(rf"<{t}\s*>(.*?)</{t}\s*>", re.IGNORECASE | re.DOTALL) for t in _ACTION}
_OPEN_RE = {t: re.compile(rf"<{t}\s*>", re.IGNORECASE) for t in _ACTION}
_CJK_RE = re.compile("[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")  # ideographs, CJK punctuation
_CLOSE_RE = {t: re.compile(rf"</{t}\s*>", re.IGNORECASE) for t in _ACTION}


def _ref_parse(text: str, tags: tuple[str, ...], require_think: bool) -> tuple:
    """The regex formulation of §1.5 and of the strict check (quadratic on unclosed tags; short inputs only)."""
    m = _THINK_RE.search(text)
    thinking = m.group(1).strip() if m else ""
    action, tag = "", None
    for t in tags:
        m = _TAG_RE[t].search(text)
        if m is not None:
            action, tag = m.group(1).strip(), t
            break
    ok, reason = _ref_check(text, tags, require_think, bool(thinking))
    if ok and tag is None:
        for t in tags:
            m = _TAG_RE_CI[t].search(text)
            if m is not None:
                action, tag = m.group(1).strip(), t
                break
    return thinking, bool(thinking), action, bool(action), tag, ok, reason


def _ref_check(text: str, tags: tuple[str, ...], require_think: bool, thinking_valid: bool) -> tuple[bool, str]:
    if _CJK_RE.search(text):
        return False, "cjk"
    if require_think and not thinking_valid:
        return False, "no_think"
    blocks = 0
    for t in _ACTION:
        n_open, n_close = len(_OPEN_RE[t].findall(text)), len(_CLOSE_RE[t].findall(text))
        if n_open != n_close:
            return False, f"unbalanced_{t}"
        if n_open and t not in tags:
            return False, f"tag_{t}_not_allowed"
        blocks += n_open
    if blocks != 1:
        return False, "no_action" if blocks == 0 else "multiple_actions"
    for t in tags:
        m = _TAG_RE_CI[t].search(text)
        if m is not None:
            inner = m.group(1)
            if any(_OPEN_RE[u].search(inner) or _CLOSE_RE[u].search(inner) for u in _ACTION):
                return False, "nested"
            return (False, "empty_action") if not inner.strip() else (True, "")
    return False, "no_action"


# Pieces that exercise every branch: tag heads with and without '>', attributes, word boundaries, white
# space inside closers, upper case, and the non-ASCII characters a case-insensitive regex folds onto the
# letters of the tag names (Kelvin sign, long s, dotted and dotless I).
_PIECES = [
    "<think>", "</think>", "<THINK a=1>", "<thinking>", "<think", "</think >", "</Think\n>", "<think_x>",
    "<action>", "</action>", "<ACTION >", "</Action\t>", "<action", "</action", "<search>", "</search>",
    "<SEARCH>", "</search >", "<answer>", "</answer>", "<Answer  >", "</ANSWER>", "<thin\u212a>", "</\u212aHINK>",
    "<\u017fearch>", "</\u017fearch>", "<act\u0130on>", "</act\u0131on>", "go north", " ", "\n", "\t", "x", "K",
    "\u4e2d", "<", ">", "/", "=", "_", "1", "\u00a0", "\u2003",
]  # fmt: skip
_TAG_SETS = [("action",), ("search", "answer"), ("action", "search", "answer"), ("answer", "action")]


def _generated(n: int, seed: int = 0) -> list[str]:
    """Half free sequences of pieces, half a think block and an action block with pieces around them."""
    rng = random.Random(seed)

    def noise(k: int) -> str:
        return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, k)))

    out = []
    for i in range(n):
        if i % 2:
            out.append(noise(24))
            continue
        tag = rng.choice(_ACTION)
        head = rng.choice([f"<{tag}>", f"<{tag.upper()} >", f"<{tag.title()}\n>"])
        tail = rng.choice([f"</{tag}>", f"</{tag.upper()}>", f"</{tag} >"])
        think = rng.choice(["<think>", "<THINK id=1>", "<think\n>"]) + noise(3) + rng.choice(["</think>", "</Think >"])
        out.append(noise(2) + think + noise(2) + head + noise(3) + tail + noise(2))
    return out


def test_fuzz_linear_scanner_equals_the_regexes():
    """10,000 generated strings: no exception, well-formed results, identical to the regex formulation."""
    texts = _generated(10_000)
    agree_ok = 0
    for k, text in enumerate(texts):
        tags = _TAG_SETS[k % len(_TAG_SETS)]
        require_think = k % 3 != 0
        p = parse_response(text, tags, require_think=require_think)
        got = (p.thinking, p.thinking_valid, p.action, p.action_valid, p.tag, p.well_formed, p.reason)
        assert got == _ref_parse(text, tags, require_think), text
        assert p.thinking == p.thinking.strip() and p.action == p.action.strip()
        assert p.well_formed == (p.reason == "") and (p.tag is None or p.tag in tags)
        if p.well_formed:
            assert p.action_valid and p.action and not _CJK_RE.search(p.action)
        agree_ok += p.well_formed
    assert agree_ok > 50  # the generator reaches the accepting path, not only rejections


def _adversarial(n: int) -> dict[str, str]:
    """Inputs that made the regexes quadratic (an opener repeated, its closer missing) and friends."""
    return {
        "unclosed_think": ("<think>" * n)[:n],
        "unclosed_think_head": ("<think " * n)[:n],
        "unclosed_action": ("<think>a</think>" + "<action>" * n)[:n],
        "unclosed_upper_action": ("<think>a</think>" + "<ACTION  >" * n)[:n],
        "unclosed_search": ("<think>a</think>" + "<search>x" * n)[:n],
        "open_close_spaces": ("<action" + " " * 50 + "</action" + " " * 50) * (n // 116 + 1),
    }


def _min_times(texts: list[str], repeat: int = 7) -> list[float]:
    """Minimum over ``repeat`` rounds of each text's parse time; the texts are interleaved in every round
    so that a change of load on the machine affects all of them alike."""
    best = [float("inf")] * len(texts)
    for _ in range(repeat):
        for k, text in enumerate(texts):
            t0 = time.perf_counter()
            parse_response(text)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("kind", sorted(_adversarial(10)))
def test_parsing_is_linear_in_the_length(kind):
    """10x the length costs ~10x the time (quadratic: 100x); the minimum of several timings, a wide bound."""
    t_small, t_large = _min_times([_adversarial(5_000)[kind], _adversarial(50_000)[kind]])
    ratio = t_large / max(t_small, 1e-7)
    assert ratio < 35, f"{kind}: 10x the input took {ratio:.0f}x the time"
