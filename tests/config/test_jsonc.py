"""The JSON-with-comments parser agrees with the json module on plain JSON, and where it differs
(comments, trailing commas) it is on purpose."""

from __future__ import annotations

import json
import random

import pytest

from zerorun.config.jsonc import JsoncError, parse_jsonc


def _value(rng: random.Random, depth: int) -> object:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-(10**12), 10**12)
    if kind == 2:
        return rng.choice([0.0, -0.5, 1e-8, 5e8, 3.14159, -2.5e-300, 1.7e308])
    if kind in (3, 4):
        alphabet = 'ab "\\/\n\t{}[],:#*é漢\u2028'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(8))) + rng.choice(["", "//x", "/*y*/"])
    if kind in (5, 6):
        return {f"k{i}{rng.choice(['', '//', '#'])}": _value(rng, depth + 1) for i in range(rng.randrange(5))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_json_on_plain_json(seed):
    rng = random.Random(seed)
    for _ in range(60):
        doc = {"root": _value(rng, 0)}
        text = json.dumps(doc, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
        value, _ = parse_jsonc(text)
        assert value == json.loads(text)


def test_comments_and_trailing_commas_are_whitespace():
    text = '# top\n{ /* a */ "a": [1, 2, /* x */ 3,], // end\n "b": {"c": "//not a comment",}, }\n// tail\n'
    value, where = parse_jsonc(text)
    assert value == {"a": [1, 2, 3], "b": {"c": "//not a comment"}}
    assert where[("a",)] == (2, 11) and where[("b", "c")] == (3, 8) and where[("a", 2)] == (2, 31)


@pytest.mark.parametrize(
    "text,line,column",
    [
        ("{\n  \"a\": 01\n}", 2, 9),  # leading zero: the parser stops after `0`
        ("{\"a\": [1 2]}", 1, 10),
        ("{\"a\": \"unterminated}", 1, 7),
        ("{\"a\": 1}}", 1, 9),
        ("[1, 2,", 1, 7),
        ("{\"a\" 1}", 1, 6),
    ],
)
def test_errors_have_positions(text, line, column):
    with pytest.raises(JsoncError) as info:
        parse_jsonc(text)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)
