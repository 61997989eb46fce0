"""Bounded YAML of config text (alignopsd.config_yaml) and the --set parser that uses it."""

from __future__ import annotations

import time

import pytest
import yaml

from alignopsd.config import override_mapping
from alignopsd.config_yaml import MAX_DEPTH, MAX_NODES, MAX_VALUE_BYTES, YamlLimitError, load_yaml


def _nested(levels: int) -> str:
    """A top-level mapping (level 1) holding ``levels - 1`` nested flow lists."""
    return "x: " + "[" * (levels - 1) + "]" * (levels - 1)


def _laughs(levels: int, width: int = 10) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_depth_limit_is_exact():
    lists, node = 0, load_yaml(_nested(MAX_DEPTH))["x"]
    while isinstance(node, list):
        lists, node = lists + 1, node[0] if node else None
    assert lists == MAX_DEPTH - 1  # levels 2..MAX_DEPTH
    with pytest.raises(YamlLimitError, match=f"nested deeper than the limit of {MAX_DEPTH} levels") as e:
        load_yaml(_nested(MAX_DEPTH + 1))
    assert e.value.problem_mark.line == 0 and e.value.problem_mark.column == 3 + MAX_DEPTH - 1


def test_node_limit_counts_aliases_at_their_expanded_size():
    # a0 is 11 values, a1 10*11+1, a2 1,111, a3 11,111: with its mapping and keys a0..a3 is 12,349 values
    assert load_yaml(_laughs(4))["a3"][9][9][9] == ["lol"] * 10
    with pytest.raises(YamlLimitError, match=f"more than the limit of {MAX_NODES} values") as e:
        load_yaml(_laughs(5))
    assert e.value.problem_mark.line == 4  # refused on the line of a4, before a4 is built
    start = time.perf_counter()  # the full billion laughs (10^9 strings) ends as fast
    with pytest.raises(YamlLimitError):
        load_yaml(_laughs(9))
    assert time.perf_counter() - start < 1.0
    assert len(load_yaml("[" + "1," * 49 + "]", max_nodes=50)) == 49  # the list and 49 values: exactly the bound
    with pytest.raises(YamlLimitError, match="more than the limit of 50 values"):
        load_yaml("[" + "1," * 50 + "]", max_nodes=50)


def test_alias_depth_and_self_reference():
    chain = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 70))
    with pytest.raises(YamlLimitError, match="nested deeper"):  # 70 one-line anchors, 71 levels once expanded
        load_yaml(chain)
    for text in ("x: &a [*a]", "x: &a {k: *a}", "x: &a [1, [2, *a]]"):
        with pytest.raises(YamlLimitError, match=r"alias \*a is inside the value it names"):
            load_yaml(text)
    assert load_yaml("d: &d {lr: 1}\ne: *d\n") == {"d": {"lr": 1}, "e": {"lr": 1}}


def test_still_a_safe_loader():
    with pytest.raises(yaml.constructor.ConstructorError):
        load_yaml("x: !!python/object/apply:os.system [echo]")
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: 1\n---\nb: 2\n")


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("env.options.x=" + "[" * 5000 + "]" * 5000, "env.options.x: cannot parse value .* nested deeper than"),
        ("a.b.c.d=" + "[" * 61 + "]" * 61, r"a.b.c.d: .*limit of 60 levels"),  # 4 levels of key, 60 of value
        ("env.options.x=" + "x" * MAX_VALUE_BYTES, f"over the limit of {MAX_VALUE_BYTES} bytes"),
        (".".join(["k"] * (MAX_DEPTH + 1)) + "=1", f"a key of {MAX_DEPTH + 1} parts"),
        ("x=&a [*a]", r"x: cannot parse value '&a \[\*a\]' \(line 1, column 5: alias \*a is inside"),
        ("x=" + _laughs(9).replace("\n", ", ").join("{}"), "more than the limit"),
        ("trainer.lr=[1,", r"trainer.lr: cannot parse value '\[1,' \(line 1, column 4: while parsing a flow node"),
    ],
)
def test_override_values_are_bounded_with_one_line_messages(item, match):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as e:
        override_mapping({}, [item], what="--set")
    assert time.perf_counter() - start < 2.0
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_override_within_bounds_keeps_working():
    deepest = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)  # under a 2-part key
    out = override_mapping({"a": {"b": 1}}, ["a.c=" + deepest, "a.d={k: [1, 2]}", "a.b="])
    assert out["a"]["b"] == "" and out["a"]["d"] == {"k": [1, 2]}
    assert str(out["a"]["c"]) == deepest
