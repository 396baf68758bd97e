"""What drain.settings.libpq_url and drain.settings.urls share: where a URL's secrets are, and
the error for one that cannot be read (see drain.settings.urls for the rules)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from urllib.parse import unquote

MASK = "***"
#: libpq parameters whose values are secrets (in ``key=value`` strings and in
#: a URL's query string).
SECRET_KEYWORDS = frozenset(
    {"password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key"}
)
#: :func:`scrub` replaces a password wherever it appears in free text only when
#: it is at least this long: a shorter one would match inside ordinary words.
SCRUB_MIN_LENGTH = 6



Span = tuple[int, int]

SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
DATABASE_SCHEMES = ("postgresql://", "postgres://")
#: What may follow the ``@`` that ends a user name and password: ``host[:port]``,
#: several of them for libpq, then a ``/``, ``?``, ``#`` or the end.
HOST = r"(?:\[[0-9A-Za-z:.%]*\]|[A-Za-z0-9._~%-]*)(?::[0-9]*)?"
HOST_TAIL = re.compile(rf"{HOST}(?:,{HOST})*(?=[/?#]|\Z)")
#: Characters of a user name or password that end it early: libpq stops at the
#: first ``@`` or ``/``; kombu and urllib at ``/``, ``?``, ``#``, and refuse ``[ ]``.
DATABASE_BREAKS = "@/"
BROKER_BREAKS = "/?#[]"
BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
SPACES = " \t\n\r\f\v"  # C's isspace(), which libpq's key=value parser uses


class Malformed(Exception):
    """A URL that cannot be parsed: ``reason`` names the part, never its text.

    ``secrets`` are the password (or what may be it, both ways of cutting) for
    :func:`secrets_of`, which scrubs them from free text all the same.
    """

    def __init__(self, reason: str, secrets: Iterable[str] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.secrets = list(secrets)


@dataclasses.dataclass(frozen=True)
class Cut:
    """A URL or connection string and where its secrets are in it."""

    text: str
    spans: tuple[Span, ...] = ()
    #: The secrets as written and as decoded (percent-escapes, backslashes).
    secrets: tuple[str, ...] = ()

    def masked(self) -> str:
        """The text with each secret replaced by ``***``, every other character kept."""
        out, last = [], 0
        for start, end in sorted(self.spans):
            out += [self.text[last:start], MASK]
            last = end
        out.append(self.text[last:])
        return "".join(out)


def last_userinfo_at(text: str, start: int) -> int | None:
    """The last ``@`` after ``start`` that is followed by something host-shaped."""
    at = text.rfind("@", start)
    while at >= 0:
        if HOST_TAIL.match(text, at + 1):
            return at
        at = text.rfind("@", start, at)
    return None


def both_ways(raw: str) -> list[str]:
    """A URL's password as written and percent-decoded."""
    return [s for s in dict.fromkeys((raw, unquote(raw))) if s]


def password_of(userinfo: str) -> str:
    return userinfo.partition(":")[2]


def listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def escape_advice(userinfo: str, breaks: str, after_host: str) -> str:
    """Which characters of the user name and password to percent-escape, and how."""
    user, colon, password = userinfo.partition(":")
    advice = []
    for name, text in (("user name", user), ("password", password if colon else "")):
        found = [c for c in breaks if c in text]
        if found:
            advice.append(
                f"{listed([repr(c) for c in found])} in the {name} must be percent-escaped "
                f"as {listed([f'%{ord(c):02X}' for c in found])}"
            )
    text = "; ".join(advice) or "percent-escape the user name and password"
    if not colon:  # a user name alone: or is it an '@' after the host?
        text += f" (or, if the '@' belongs to the {after_host}, write it as %40)"
    return text


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
