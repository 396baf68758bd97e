"""``argsrepr`` read off the JSON text Postgres prints (drain.celery.message.json_repr)
equals Celery's ``saferepr`` of the decoded value, for every value it answers.

The shortcut rests on how Postgres prints a jsonb (its spacing, its order of an
object's keys), so the texts here come from Postgres itself: generated values
sent through ``%s::jsonb::text``, several thousand of them, with the shapes
arguments have and the ones the shortcut must leave to the slow way (floats,
booleans, null, quotes, escapes, non-printable and non-ASCII characters, kombu's
type markers, deep nesting, long texts).
"""

from __future__ import annotations

import json
import random
from typing import Any

import psycopg
from celery.utils.saferepr import saferepr

from drain.celery import encoding
from drain.celery.message import json_repr

STRINGS = ["", "a", "user", "it's", 'say "hi"', "back\\slash", "tab\there", "new\nline",
           "héllo", "日本", "emoji 😀", "\x07", "\u200b", "[bracket", "{brace}", "a, b: c",
           "null", "true", "__type__", "x" * 40]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 5 else 8)
    if kind < 3:
        return rng.choice([0, 1, -1, 42, -7, 10**12, -(10**20), 2**63])
    if kind < 5:
        return rng.choice(STRINGS)
    if kind == 5:
        return rng.choice([1.5, -0.25, 1e21, 3.0, 0.1])
    if kind == 6:
        return rng.choice([True, False, None])
    if kind == 7:
        return {"__type__": "datetime", "__value__": "2026-11-28T10:00:00"}
    if kind < 10:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = rng.sample(["a", "id", "user_id", "b", "long_key_name", "ké"], rng.randrange(4))
    return {k: _value(rng, depth + 1) for k in keys}


def test_the_shortcut_equals_saferepr_wherever_it_answers(db_url: str) -> None:
    rng = random.Random(38)
    values = [[_value(rng)] for _ in range(1500)] + [
        {"i": rng.randrange(1000)} for _ in range(200)] + [
        _value(rng) for _ in range(1500)] + [
        # Integers in lists, empty objects: read off the text as it is.
        [1, [2, [3, [4]]]], [{}, [], {}], [-5, 0, 2**70], [[], [[]]], [[[[]]]], {}]
    answered = 0
    with psycopg.connect(db_url) as conn:
        for value in values:
            row = conn.execute("SELECT %s::jsonb::text", [json.dumps(value)]).fetchone()
            assert row is not None
            text = str(row[0])
            for maxsize, maxlevels in ((1024, 3), (16, 3), (1024, 1)):
                fast = json_repr(text, maxsize, maxlevels)
                if fast is None:
                    continue
                answered += 1
                decoded = encoding.decode(text)
                assert fast == str(saferepr(decoded, maxsize, maxlevels=maxlevels)), text
    # The shortcut is taken often enough for the comparison to mean something.
    assert answered > 1500, answered


def test_what_it_leaves_to_the_slow_way() -> None:
    for text in ('[1.5]', '[true]', '[null]', '["it\'s"]', '["a\\"b"]', '["\\n"]',
                 '[{"__type__": "datetime", "__value__": "x"}]', '[[[[1]]]]',
                 '["\u200b"]', "[" + "1, " * 400 + "1]"):
        assert json_repr(text) is None, text
    # A long number before what fails the match is read once, not split every way
    # (a backtrack exponential in its digits hung this test).
    assert json_repr("[" + "1234567890" * 300 + ".5]", maxsize=100_000) is None
    assert json_repr('[1, "a", {"b": [2]}]') == "[1, 'a', {'b': [2]}]"
    assert json_repr('{"user_id": 42}') == "{'user_id': 42}"
