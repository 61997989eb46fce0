"""Response parsing: ALGORITHM.md §1.5 and §6 case 3, plus the manager's strict validity."""

from __future__ import annotations

import pytest
from alignopsd.engine.envs.parsing import check_response, contains_cjk, parse_action, parse_response, parse_thinking
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
    assert contains_cjk("中文") and not contains_cjk("plain")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/actionthinksearchanswer 中\n")), max_size=80))
def test_never_raises_on_any_text(text):
    p = parse_response(text)
    assert isinstance(p.well_formed, bool)
    if p.well_formed:
        assert p.action and p.action == p.action.strip()
