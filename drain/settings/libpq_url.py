"""Database URLs and ``key=value`` strings, cut the way libpq cuts them.

libpq (``psycopg.conninfo.conninfo_to_dict``) decides what parses; the two
patterns here only say where each part is written, so that a string that
parses is masked character for character and one that does not is refused
naming the part that is wrong (libpq's own messages quote the text, the
password included). :func:`cut_database` gives the secrets' places, or raises
:class:`drain.settings.url_parts.Malformed`; the rules are in drain.settings.urls.

What libpq does not check and this module does: a URL libpq parses, but not
as its writer meant. ``postgresql://app:Zq@x#Y/wk@db/x`` is, to libpq, the
password ``Zq``, the host ``x#Y`` and the database ``wk@db/x``; masked by those
parts it would show ``x#Y/wk``, most of the password. A later ``@`` followed by
``host[:port]`` (:func:`drain.settings.url_parts.last_userinfo_at`) marks it,
and it is refused with the characters to escape. Ports too: libpq takes any
text as a port until it connects.
"""

from __future__ import annotations

import functools
import re
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

#: After the scheme, as libpq's ``conninfo_uri_parse_options`` reads it: the user
#: name and password end at the first ``@`` before any ``/``, the password at
#: the user name's first ``:``; hosts, ``/dbname``, ``?query``.
_URL = re.compile(r"(?:(?P<user>[^:@/]*)(?::(?P<password>[^@/]*))?@)?"
                  r"(?P<hosts>[^/?]*)(?:/(?P<dbname>[^?]*))?(?:\?(?P<query>.*))?", re.S)
#: One host of a URL's list: ``[IPv6]`` or a name, then ``:port``.
_HOST = re.compile(r"(?:\[(?P<v6>[^\]]*)(?P<close>\])?|(?P<name>[^:]*))(?P<after>.*)", re.S)
_W = f"[{SPACES}]"
#: One item of a ``key=value`` string, as libpq's ``conninfo_parse`` reads it: a
#: value is single-quoted or a bare word; ``\\`` escapes the next character in both.
_ITEM = re.compile(
    rf"{_W}*(?P<key>[^={SPACES}]*){_W}*(?:={_W}*(?P<value>"
    rf"'(?:\\.|\\\Z|[^\\'])*(?P<close>')?|(?:\\.|\\\Z|[^\\{SPACES}])*))?", re.S)


@functools.cache
def _libpq_keywords() -> frozenset[str]:
    """The connection parameters this libpq knows (``ssl`` too, in URLs)."""
    return frozenset(o.keyword.decode() for o in pq.Conninfo.get_defaults()) | {"ssl"}


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _libpq_parse(dsn: str, secrets: list[str]) -> dict[str, str]:
    """libpq's reading; of its refusal only the words before its first quote (the rest
    may be the password)."""
    try:
        return {key: str(value) for key, value in conninfo.conninfo_to_dict(dsn).items()}
    except Exception as exc:
        text = first_line(exc).split('"', 1)[0].rstrip(" :")
        raise Malformed(f"libpq cannot parse it ({text})" if text else "libpq cannot parse it",
                        secrets) from None


def cut_database(dsn: str) -> Cut:
    """Cut a libpq URL or ``key=value`` string; :class:`Malformed` when it cannot be."""
    if dsn.startswith(DATABASE_SCHEMES):
        return _cut_url(dsn)
    scheme = SCHEME.match(dsn.lstrip())
    if scheme:
        if dsn.lstrip().startswith(DATABASE_SCHEMES):
            raise Malformed("it starts with spaces")
        raise Malformed(
            f"the scheme must be postgresql:// or postgres://, not {scheme.group(0)}"
            + (" (libpq's are lower case)" if scheme.group(0).lower() in DATABASE_SCHEMES
               else "")
        )
    return _cut_keywords(dsn)


def _cut_url(url: str) -> Cut:
    """Cut a ``postgresql://`` URL as libpq does, and refuse what libpq would misread."""
    start = url.index("://") + 3
    found = _URL.fullmatch(url, start)
    assert found is not None  # every group may be empty
    at = found.start("hosts") - 1 if found.group("user") is not None else None
    greedy = last_userinfo_at(url, start)
    candidates = [s for end in (at, greedy) if end is not None
                  for s in both_ways(password_of(url[start:end]))]
    if greedy is None or (at is not None and greedy <= at):
        return _checked_url(url, found, candidates)
    misread = Malformed(escape_advice(url[start:greedy], DATABASE_BREAKS, "database name"),
                        candidates)
    if found.group("query") is None or greedy < found.start("query"):
        raise misread
    try:  # an '@' in a query value is one only if all else is right
        return _checked_url(url, found, candidates)
    except Malformed:
        raise misread from None


def _checked_url(url: str, found: re.Match[str], candidates: list[str]) -> Cut:
    parts = [("user name", "user"), ("password", "password")]
    named: list[tuple[str, str]] = [(what, text) for what, group in parts
                                    if (text := found.group(group)) is not None]
    ports = []
    for host in found.group("hosts").split(","):
        one = _HOST.fullmatch(host)
        assert one is not None
        if one.group("v6") is not None and one.group("close") is None:
            raise Malformed("the IPv6 address has no closing ']' (before any '/', '?' or ',')",
                            candidates)
        if one.group("v6") == "":
            raise Malformed("the IPv6 address between [ and ] is empty", candidates)
        after = one.group("after")
        if after and not after.startswith(":"):
            raise Malformed("a ':', '/', '?' or ',' must follow the IPv6 address's ']'",
                            candidates)
        named.append(("host", one.group("v6") or one.group("name") or ""))
        if after:
            named.append(("port", after[1:]))
            ports.append(after[1:])
    if found.group("dbname") is not None:
        named.append(("database name", found.group("dbname")))
    for what, text in named:
        problem = _part_problem(f"the {what}", text, at_sign=what != "password")
        if problem:
            raise Malformed(problem, candidates)
    for port in ports:
        _check_port(unquote(port), candidates)
    spans = [found.span("password")] if found.group("password") is not None else []
    secrets = both_ways(found.group("password") or "")
    if found.group("query") is not None:
        _query_secrets(url, found.start("query"), spans, secrets)
    _libpq_parse(url, secrets)
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


def _check_port(port: str, secrets: list[str]) -> None:
    """libpq takes any text as a port until it connects: check it now."""
    for text in port.split(","):
        one = text.strip()
        if one and not one.isdigit():
            raise Malformed("the port is not a number", secrets)
        if one and not 0 < int(one) < 65536:
            raise Malformed("the port is out of range (1 to 65535)", secrets)


def _cut_keywords(dsn: str) -> Cut:
    """Cut a libpq ``key=value`` string; the values of :data:`SECRET_KEYWORDS` are secret."""
    spans: list[Span] = []
    secrets: list[str] = []
    keys: list[str] = []
    pos = 0
    while dsn[pos:].strip(SPACES):
        item = _ITEM.match(dsn, pos)
        assert item is not None  # every part may be empty
        key, value = item.group("key"), item.group("value")
        what = f"the value of {key}" if key in _libpq_keywords() else "a value"
        if value is None:
            if not keys:
                raise Malformed("neither a postgresql:// URL nor key=value pairs", secrets)
            after = f" after the value of {keys[-1]}" if keys[-1] in _libpq_keywords() else ""
            raise Malformed(
                f"the {_ordinal(len(keys) + 1)} item{after} has no '=' (a value with "
                "spaces must be single-quoted: key='a b', with \\' for a quote)", secrets)
        quoted = value.startswith("'")
        if key in SECRET_KEYWORDS:
            inner = value[1:len(value) - bool(item.group("close"))] if quoted else value
            decoded = re.sub(r"\\(.?)", r"\1", inner, flags=re.S)
            secrets += [s for s in (decoded, value) if s]
            spans.append(item.span("value"))
        if quoted and item.group("close") is None:
            raise Malformed(f"{what} has no closing quote (a quote inside a quoted value is "
                            "written \\')", secrets)
        keys.append(key)
        pos = item.end()
    for i, key in enumerate(keys, 1):
        if key not in _libpq_keywords():
            hint = (f" (libpq's are lower case: {key.lower()})" if key.lower() in
                    _libpq_keywords() else " (a value with spaces must be single-quoted: "
                    "key='a b')")
            raise Malformed(f"the {_ordinal(i)} item is not a libpq connection parameter"
                            + hint, secrets)
    params = _libpq_parse(dsn, secrets)
    _check_port(params.get("port", ""), secrets)
    return Cut(dsn, tuple(spans), tuple(dict.fromkeys(secrets)))
