"""Numeric command-line options and their ``DRAIN_*`` environment variables.

Every numeric setting is checked the same way whether it comes from a flag or
from its environment variable, before anything connects: a value that is not
a number, not finite, or out of range ends the command with one line naming
the flag or the variable, and exit code 2. A flag wins over its variable. A
variable set to the empty string counts as unset (``DRAIN_BATCH_SIZE=`` in an
env file means "the default"). (The URLs are not numbers: an empty
``DRAIN_DATABASE_URL`` means libpq's defaults, an empty broker URL is refused.)

:func:`add` declares such an option; :func:`apply_env` fills in, after
parsing, the options that were not given as flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable

#: The namespace attribute listing the options :func:`apply_env` fills in.
_ENV_OPTIONS = "env_options"
#: The namespace attribute holding the declaring parser's ``error``.
_ERROR = "env_error"


@dataclasses.dataclass(frozen=True)
class Number:
    """An argparse ``type``: a whole or a decimal number within bounds.

    ``low``/``high`` are inclusive; ``above`` is an exclusive lower bound
    (``above=0``: positive).
    """

    whole: bool
    low: float | None = None
    high: float | None = None
    above: float | None = None

    def __call__(self, text: str) -> int | float:
        value = self.parse(text)
        problem = self.out_of_range(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text.strip()!r}")
        return value

    def parse(self, text: str) -> int | float:
        if self.whole:
            try:
                return int(text.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        return number

    def out_of_range(self, value: float) -> str | None:
        low, high = self.low, self.high
        if self.above is not None and not value > self.above:
            return "must be positive" if self.above == 0 else f"must be above {self.above:g}"
        if low is not None and high is not None and not low <= value <= high:
            return f"must be from {low:g} to {high:g}"
        if low is not None and value < low:
            return f"must be at least {low:g}" if low else "must be 0 or more"
        if high is not None and value > high:
            return f"must be at most {high:g}"
        return None


POSITIVE_SECONDS = Number(whole=False, above=0)
SECONDS_OR_ZERO = Number(whole=False, low=0)
COUNT = Number(whole=True, low=1)
INDEX = Number(whole=True, low=0)
PORT = Number(whole=True, low=0, high=65535)
INT64 = Number(whole=True, low=-(2**63), high=2**63 - 1)


def add(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    env: str,
    default: int | float,
    parse: Callable[[str], int | float],
    metavar: str,
    help: str,
) -> None:
    """A numeric option that may also come from ``env``; ``help`` gets "(env X, default D)"."""
    action = parser.add_argument(
        flag, type=parse, default=None, metavar=metavar,
        help=f"{help} (env {env}, default {default})",
    )
    options: list[tuple[str, str, int | float, Callable[[str], int | float]]] = (
        parser.get_default(_ENV_OPTIONS) or []
    )
    parser.set_defaults(**{_ENV_OPTIONS: [*options, (action.dest, env, default, parse)],
                           _ERROR: parser.error})


def apply_env(args: argparse.Namespace) -> None:
    """Give every :func:`add` option not set by its flag its variable's value or its default.

    A value that is not acceptable goes, in one line naming the variable, to
    the ``error`` of the (sub)parser that declared the option: usage and exit 2.
    """
    for dest, env, default, parse in getattr(args, _ENV_OPTIONS, None) or []:
        if getattr(args, dest) is not None:
            continue
        text = os.environ.get(env, "")
        if not text.strip():
            setattr(args, dest, default)
            continue
        try:
            setattr(args, dest, parse(text))
        except argparse.ArgumentTypeError as exc:
            # add() stored the declaring parser's error next to the option.
            getattr(args, _ERROR)(f"environment variable {env}: {exc}")
