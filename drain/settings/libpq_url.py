"""Database URLs and ``key=value`` strings, cut the way libpq cuts them.

:func:`cut_database` finds the secrets of a connection string (the rules are
in drain.settings.urls), or raises :class:`drain.settings.url_parts.Malformed` naming the part
that is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
from urllib.parse import unquote

from psycopg import conninfo, pq

from drain.settings.url_parts import (
    BAD_ESCAPE,
    DATABASE_BREAKS,
    DATABASE_SCHEMES,
    SCHEME,
    SECRET_KEYWORDS,
    SPACES,
    Cut,
    Malformed,
    Span,
    both_ways,
    escape_advice,
    first_line,
    last_userinfo_at,
    password_of,
)


@functools.cache
def _libpq_keywords() -> frozenset[str]:
    """The connection parameters this libpq knows (``ssl`` too, in URLs)."""
    return frozenset(o.keyword.decode() for o in pq.Conninfo.get_defaults()) | {"ssl"}


def _libpq_refusal(exc: Exception) -> str:
    """libpq's reason, without the text it quotes (which may be the password)."""
    text = first_line(exc).split('"', 1)[0].rstrip(" :")
    return f"libpq cannot parse it ({text})" if text else "libpq cannot parse it"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def cut_database(dsn: str) -> Cut:
    """Cut a libpq URL or ``key=value`` string; :class:`Malformed` when it cannot be."""
    if dsn.startswith(DATABASE_SCHEMES):
        return _cut_database_url(dsn)
    scheme = SCHEME.match(dsn.lstrip())
    if scheme:
        if dsn.lstrip().startswith(DATABASE_SCHEMES):
            raise Malformed("it starts with spaces")
        raise Malformed(
            f"the scheme must be postgresql:// or postgres://, not {scheme.group(0)}"
            + (" (libpq's are lower case)" if scheme.group(0).lower() in DATABASE_SCHEMES
               else "")
        )
    return _cut_database_keywords(dsn)


@dataclasses.dataclass
class _LibpqUrl:
    """A ``postgresql://`` URL cut as libpq's ``conninfo_uri_parse_options`` cuts it."""

    #: (what, span): "user name", "password", "host", "port", "database name".
    parts: list[tuple[str, Span]]
    ports: list[str]
    query: Span | None = None
    #: What libpq itself would refuse in the host list, if anything.
    problem: str | None = None


def _libpq_url(url: str, start: int, at: int | None) -> _LibpqUrl:
    """``user[:password]@``, ``host[:port][,...]``, ``/dbname``, ``?query``, as libpq reads them."""
    n = len(url)
    cut = _LibpqUrl([], [])
    p = start
    if at is not None:
        colon = url.find(":", start, at)
        cut.parts.append(("user name", (start, at if colon < 0 else colon)))
        if colon >= 0:
            cut.parts.append(("password", (colon + 1, at)))
        p = at + 1
    while True:
        p = _libpq_host(url, p, cut)
        if cut.problem is not None:
            return cut
        if p < n and url[p] == ":":
            q = p + 1
            while q < n and url[q] not in "/?,":
                q += 1
            cut.parts.append(("port", (p + 1, q)))
            cut.ports.append(url[p + 1:q])
            p = q
        if p < n and url[p] == ",":
            p += 1
            continue
        break
    if p < n and url[p] == "/":
        q = url.find("?", p + 1)
        q = n if q < 0 else q
        cut.parts.append(("database name", (p + 1, q)))
        p = q
    if p < n and url[p] == "?":
        cut.query = (p + 1, n)
    return cut


def _libpq_host(url: str, p: int, cut: _LibpqUrl) -> int:
    """One host name or ``[IPv6]`` address at ``p``; where it ends (sets ``cut.problem``)."""
    n = len(url)
    if p < n and url[p] == "[":
        close = url.find("]", p)
        if close < 0:
            cut.problem = "the IPv6 address has no closing ']'"
        elif close == p + 1:
            cut.problem = "the IPv6 address between [ and ] is empty"
        elif close + 1 < n and url[close + 1] not in ":/?,":
            cut.problem = "a ':', '/', '?' or ',' must follow the IPv6 address's ']'"
        else:
            cut.parts.append(("host", (p + 1, close)))
        return close + 1
    q = p
    while q < n and url[q] not in ":/?,":
        q += 1
    cut.parts.append(("host", (p, q)))
    return q


def _cut_database_url(url: str) -> Cut:
    """Cut a ``postgresql://`` URL as libpq does, and refuse what libpq would misread."""
    start = url.index("://") + 3
    slash = url.find("/", start)
    found = url.find("@", start, len(url) if slash < 0 else slash)
    at = found if found >= 0 else None
    greedy = last_userinfo_at(url, start)
    candidates = []
    for end in (at, greedy):
        if end is not None:
            candidates += both_ways(password_of(url[start:end]))
    cut = _libpq_url(url, start, at)

    # An '@' further right than libpq's that could end the user name and password:
    # an unescaped '/' or '@' in them, unless it is only a query value's '@'.
    if greedy is not None and (at is None or greedy > at):
        in_query = cut.query is not None and greedy >= cut.query[0]
        if not (in_query and cut.problem is None and all(p.isdigit() for p in cut.ports)
                and _libpq_parses(url)):
            raise Malformed(
                escape_advice(url[start:greedy], DATABASE_BREAKS, "database name"), candidates
            )
    if cut.problem is not None:
        raise Malformed(cut.problem, candidates)
    for name, (begin, end) in cut.parts:
        problem = _part_problem(f"the {name}", url[begin:end], at_sign=name != "password")
        if problem:
            raise Malformed(problem, candidates)
    for port in cut.ports:
        _check_port(unquote(port), candidates)
    spans = [span for name, span in cut.parts if name == "password"]
    secrets = [s for begin, end in spans for s in both_ways(url[begin:end])]
    if cut.query is not None:
        _query_secrets(url, cut.query[0], spans, secrets)
    try:
        conninfo.conninfo_to_dict(url)
    except Exception as exc:
        raise Malformed(_libpq_refusal(exc), secrets) from None
    return Cut(url, tuple(spans), tuple(dict.fromkeys(secrets)))


def _part_problem(what: str, text: str, *, at_sign: bool) -> str | None:
    """What libpq would refuse (or misread) in one part of a URL, named, not quoted.

    ``at_sign``: an ``@`` there means one in the user name or password was not escaped.
    """
    if at_sign and "@" in text:
        return (f"{what} contains '@': an '@' in the user name or password must be "
                "percent-escaped as %40")
    if " " in text:
        return f"{what} contains a space: write it as %20"
    if BAD_ESCAPE.search(text):
        return f"{what} has a '%' that does not start a %XX escape: write '%' as %25"
    if "%00" in text:
        return f"{what} contains %00, which libpq refuses"
    return None


def _query_secrets(url: str, start: int, spans: list[Span], secrets: list[str]) -> None:
    """Check a URL's query string as libpq reads it; add its secrets' spans and values."""
    q = start
    for i, item in enumerate(url[start:].split("&"), 1):
        key, eq, value = item.partition("=")
        which = f"the {_ordinal(i)} query parameter"
        if not eq:
            raise Malformed(f"{which} has no '='", secrets)
        if "=" in value:
            raise Malformed(f"{which} has a second '=': write it as %3D", secrets)
        problem = _part_problem(which, item, at_sign=False)
        if problem:
            raise Malformed(problem, secrets)
        name = unquote(key)
        if name not in _libpq_keywords():
            raise Malformed(f"{which} is not a libpq connection parameter", secrets)
        if name in SECRET_KEYWORDS:
            value_start = q + len(key) + 1
            spans.append((value_start, value_start + len(value)))
            secrets += both_ways(value)
        q += len(item) + 1


def _libpq_parses(url: str) -> bool:
    try:
        conninfo.conninfo_to_dict(url)
    except Exception:
        return False
    return True


def _check_port(port: str, secrets: list[str]) -> None:
    """libpq takes any text as a port until it connects: check it now."""
    for text in port.split(","):
        one = text.strip()
        if one and not one.isdigit():
            raise Malformed("the port is not a number", secrets)
        if one and not 0 < int(one) < 65536:
            raise Malformed("the port is out of range (1 to 65535)", secrets)


@dataclasses.dataclass(frozen=True)
class _Item:
    """One ``key=value`` of a libpq connection string."""

    key: str
    #: Where the value is written, quotes included.
    span: Span
    value: str


def _keyword_items(dsn: str) -> list[_Item]:
    """Split a ``key=value`` string exactly as libpq's ``conninfo_parse`` does."""
    items: list[_Item] = []
    secrets: list[str] = []
    i, n = 0, len(dsn)
    while i < n:
        if dsn[i] in SPACES:
            i += 1
            continue
        key_start = i
        while i < n and dsn[i] != "=" and dsn[i] not in SPACES:
            i += 1
        key = dsn[key_start:i]
        while i < n and dsn[i] in SPACES:
            i += 1
        if i >= n or dsn[i] != "=":
            if not items:
                raise Malformed("neither a postgresql:// URL nor key=value pairs", secrets)
            last = items[-1].key
            after = f" after the value of {last}" if last in _libpq_keywords() else ""
            raise Malformed(
                f"the {_ordinal(len(items) + 1)} item{after} has no '=' (a value with "
                "spaces must be single-quoted: key='a b', with \\' for a quote)", secrets)
        i += 1
        while i < n and dsn[i] in SPACES:
            i += 1
        value, end = _keyword_value(dsn, i)
        if value is None:
            if key in SECRET_KEYWORDS:
                secrets.append(dsn[i:])
            what = f"the value of {key}" if key in _libpq_keywords() else "a value"
            raise Malformed(f"{what} has no closing quote (a quote inside a quoted value is "
                             "written \\')", secrets)
        items.append(_Item(key, (i, end), value))
        if key in SECRET_KEYWORDS:
            secrets += [value, dsn[i:end]]
        i = end
    return items


def _keyword_value(dsn: str, i: int) -> tuple[str | None, int]:
    """The value starting at ``i`` and where it ends; None when a quote is not closed."""
    n = len(dsn)
    quoted = i < n and dsn[i] == "'"
    if quoted:
        i += 1
    value: list[str] = []
    while i < n:
        c = dsn[i]
        if c == "\\":
            if i + 1 < n:
                value.append(dsn[i + 1])
            i += 2
        elif quoted and c == "'":
            return "".join(value), i + 1
        elif not quoted and c in SPACES:
            break
        else:
            value.append(c)
            i += 1
    if quoted:
        return None, n
    return "".join(value), min(i, n)


def _cut_database_keywords(dsn: str) -> Cut:
    """Cut a libpq ``key=value`` string; the values of :data:`SECRET_KEYWORDS` are secret."""
    items = _keyword_items(dsn)
    secret_items = [item for item in items if item.key in SECRET_KEYWORDS]
    secrets = [s for item in secret_items
               for s in (item.value, dsn[item.span[0]:item.span[1]]) if s]
    for i, item in enumerate(items, 1):
        if item.key not in _libpq_keywords():
            hint = (f" (libpq's are lower case: {item.key.lower()})"
                    if item.key.lower() in _libpq_keywords()
                    else " (a value with spaces must be single-quoted: key='a b')")
            raise Malformed(f"the {_ordinal(i)} item is not a libpq connection parameter"
                             + hint, secrets)
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except Exception as exc:
        raise Malformed(_libpq_refusal(exc), secrets) from None
    _check_port(str(params.get("port") or ""), secrets)
    return Cut(dsn, tuple(item.span for item in secret_items), tuple(dict.fromkeys(secrets)))
