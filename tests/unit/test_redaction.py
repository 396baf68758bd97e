"""drain.redaction: the hook that redacts arguments before they are shown fails closed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from drain import redaction
from drain.errors import ConfigError


def _mask(task_name: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    return ["<hidden>" for _ in args], {k: "<hidden>" for k in kwargs}


def test_without_a_redactor_the_arguments_are_shown_as_stored() -> None:
    assert redaction.shown(None, "t", '[1, "a@b.c"]', '{"k": 2}') == ('[1, "a@b.c"]', '{"k": 2}')


def test_a_redactor_gets_the_task_and_the_decoded_arguments() -> None:
    assert redaction.shown(_mask, "t", '[1, "a@b.c"]', '{"k": 2}') == (
        '["<hidden>", "<hidden>"]', '{"k": "<hidden>"}')


@pytest.mark.parametrize(("redactor", "failure"), [
    (lambda name, args, kwargs: 1 / 0, "ZeroDivisionError"),
    (lambda name, args, kwargs: ("not a list", {}), "TypeError"),
    (lambda name, args, kwargs: None, "TypeError"),  # cannot be unpacked
])
def test_a_failing_redactor_shows_none_of_the_arguments(redactor: Any, failure: str) -> None:
    args, kwargs = redaction.shown(redactor, "t", '["secret"]', '{"token": "secret"}')
    assert "secret" not in args + kwargs
    assert json.loads(args) == [f"<redaction failed: {failure}>"]


def test_loading_a_redactor_is_one_clear_error_when_it_cannot_be() -> None:
    assert redaction.load(None) is None
    assert redaction.load("tests.unit.test_redaction:_mask") is _mask
    for spec, error in (("nocolon", "give the function as MODULE:FUNCTION"),
                        ("no_such_module_x:f", "cannot load it: ModuleNotFoundError"),
                        ("json:no_such_name", "cannot load it: AttributeError"),
                        ("json:__doc__", "str is not callable")):
        with pytest.raises(ConfigError, match=error):
            redaction.load(spec)
