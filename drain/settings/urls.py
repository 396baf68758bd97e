"""Database and broker URLs: read by their structure, checked, and masked.

Secrets in URLs
---------------
Passwords reach drain's output only through the URLs it is given, so every URL
is cut by its structure, the way the program that reads it cuts it:

* a database URL (``postgresql://`` or ``postgres://``, case-sensitive) as libpq
  does: the user name and password run up to the first ``@`` before the first
  ``/``, and the password is what follows their first ``:``; so it may hold
  ``:``, ``?``, ``#`` and ``[`` unescaped, as libpq allows. The query parameters
  of :data:`SECRET_KEYWORDS` (``?sslpassword=...``) are secrets too;
* a ``key=value`` connection string as libpq does: a value is a bare word or
  is single-quoted, ``\\'`` and ``\\\\`` escape a quote and a backslash in
  either, and the values of :data:`SECRET_KEYWORDS` are the secrets;
* a broker URL as kombu (Celery) and :mod:`urllib.parse` do: the authority ends
  at the first ``/``, ``?`` or ``#`` and the user name and password at its
  *last* ``@``, so the password may hold ``@`` and ``:`` unescaped.

Masking replaces exactly the characters of the secret with ``***`` and keeps
every other character. It never searches the text for the password: with a
short password (``a``) that would mask every ``a`` of the URL and of the
message around it, and show the password by where the masks fall.

A URL that its reader would cut elsewhere than its writer meant is refused
(exit code 2), never guessed at: when a later ``@``, one followed by what looks
like ``host[:port]`` and then ``/``, ``?`` or the end, would end the user name
and password, they hold a character their reader stops at (``/`` and ``@``
for libpq; ``/``, ``?``, ``#``, ``[``, ``]`` for kombu and pika). libpq would
connect to the wrong host or send a truncated password, so the error says
which characters of the user name or password to percent-escape, and how
(``'#' in the password must be percent-escaped as %23``). It names which
characters, never the text around them.

Nothing of a URL or connection string that cannot be parsed is echoed, masked
or not (where the password ends is what is unknown): its error names the part
that is wrong ("the port is not a number", "the 3rd item has no '='"). libpq's own
parse errors quote the text they stumble on (the password, or the whole URL),
so they are never passed on: drain checks each part first, and of any other
libpq refusal keeps only the words before its first quote.

Free text (a driver's error message, a log line) goes through :func:`scrub`:
the passwords themselves are replaced wherever they appear, the URLs in it
are masked by structure (the password of a ``scheme://...`` word runs from
the first ``:`` to its last ``@``), so are ``password=...`` pairs, and the
passwords are replaced once more; those of :data:`SCRUB_MIN_LENGTH`
characters or more and not part of the URL's readable parts (a password
equal to the user name stays, as the user name does). A shorter one is left
to the structural masking: replacing it would mangle the text, and reveal it.

Broker lists
------------
A broker URL may be a failover list, as Celery's ``broker_url`` takes it:
URLs separated by ``;`` (spaces around each are ignored here; kombu does
not ignore them). kombu splits at every ``;`` before it reads a URL, so a
``;`` in a password must be percent-escaped as ``%3B``. Each URL of a list is
checked, shown and masked on its own (:func:`broker_list_parameters`,
:func:`mask_url`), and an error names the URL by its position ("broker URL 2
of 3"). Which of them the drain connects to, and when, is drain.broker.broker_list's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import socket
import ssl
from collections.abc import Callable, Sequence
from urllib.parse import SplitResult, unquote, urlsplit

import pika

from drain.errors import ConfigError
from drain.settings.libpq_url import cut_database
from drain.settings.url_parts import (
    BROKER_BREAKS,
    DATABASE_SCHEMES,
    MASK,
    SCHEME,
    SCRUB_MIN_LENGTH,
    SECRET_KEYWORDS,
    Cut,
    Malformed,
    Span,
    both_ways,
    escape_advice,
    last_userinfo_at,
    password_of,
)


@dataclasses.dataclass(frozen=True)
class _BrokerUrl:
    """A broker URL cut as kombu cuts it (user name and password still escaped)."""

    cut: Cut
    username: str | None
    password: str | None
    #: What follows the user name and password, as urllib reads it (port checked).
    rest: SplitResult


def _cut_broker(url: str) -> _BrokerUrl:
    """Cut a broker URL as kombu and urllib do; :class:`Malformed` when it cannot be."""
    scheme = SCHEME.match(url)
    if not scheme:
        raise Malformed("it must start with amqp:// or amqps://")
    start = scheme.end()
    n = len(url)
    end = min([i for i in (url.find(c, start) for c in "/?#") if i >= 0], default=n)
    at = url.rfind("@", start, end)
    greedy = last_userinfo_at(url, start)
    candidates = [s for stop in (at, greedy) if stop is not None and stop >= 0
                  for s in both_ways(password_of(url[start:stop]))]
    if greedy is not None and greedy > end:
        raise Malformed(
            escape_advice(url[start:greedy], BROKER_BREAKS, "virtual host"), candidates
        )
    spans: tuple[Span, ...] = ()
    username = password = None
    if at >= 0:
        userinfo = url[start:at]
        if "[" in userinfo or "]" in userinfo:
            raise Malformed(escape_advice(userinfo, "[]", "host"), candidates)
        username, colon, password_text = userinfo.partition(":")
        if colon:
            password = password_text
            spans = ((start + len(username) + 1, at),)
    try:  # urllib's errors quote the URL: never shown
        rest = urlsplit(f"{scheme.group(1)}://{url[at + 1 if at >= 0 else start:]}")
        rest.port  # noqa: B018 - checked now, as kombu reads it later
    except ValueError as exc:
        text = str(exc)
        reason = ("the port is out of range (0 to 65535)" if "Port out of range" in text else
                  "the port is not a number" if "Port" in text else
                  "the host is not a valid IPv6 address in [ ]" if "IPv6" in text else
                  "the host is malformed")
        raise Malformed(reason, candidates) from None
    secrets = both_ways(password or "")
    fragment = url.find("#", end)
    fragment = n if fragment < 0 else fragment
    query = url.find("?", end, fragment)
    if query >= 0:  # refused by broker_parameters, but never shown with its secrets
        for found in re.finditer(r"(?:^|&)([^&=]*)=([^&]*)", url[query + 1:fragment]):
            if unquote(found.group(1)) in SECRET_KEYWORDS:
                spans += ((query + 1 + found.start(2), query + 1 + found.end(2)),)
                secrets += both_ways(found.group(2))
    return _BrokerUrl(Cut(url, spans, tuple(secrets)), username, password, rest)


# -- broker lists (Celery's failover syntax) -----------------------------------------

#: What separates the URLs of a broker list, with the spaces around it.
_LIST_SEPARATOR = re.compile(r"\s*;\s*")
#: In free text: a ``;`` that starts the next URL of a list.
_NEXT_URL = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def broker_list(text: str | Sequence[str]) -> list[str]:
    """The URLs of a broker list, in order: a ``;``-separated string as Celery's
    ``broker_url`` takes it (spaces around each URL are ignored), or a sequence.

    A single URL is a list of one. An empty URL in a longer list (a stray ``;``)
    raises :class:`ConfigError` naming its position.
    """
    if isinstance(text, str):
        entries = _LIST_SEPARATOR.split(text.strip())
    else:
        entries = [str(url).strip() for url in text]
    if not entries:
        raise ConfigError("the broker list is empty")
    if len(entries) > 1:
        for position, url in enumerate(entries, 1):
            if not url:
                raise ConfigError(f"broker URL {position} of {len(entries)} in the list is "
                                  "empty (a stray ';'?)")
    return entries


def broker_list_parameters(
    text: str | Sequence[str], *, heartbeat: int = 30, tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> list[tuple[str, pika.ConnectionParameters]]:
    """:func:`broker_parameters` of every URL of a broker list, each with its masked URL.

    A URL that is refused raises :class:`ConfigError` naming its position in the
    list ("broker URL 2 of 3: ..."), with the same text as a single URL's error
    (shown masked only if it could be cut, see the module's docstring).
    """
    entries = broker_list(text)
    found = []
    for position, url in enumerate(entries, 1):
        try:
            parameters = broker_parameters(url, heartbeat=heartbeat, tls=tls,
                                           server_hostname=server_hostname)
        except ConfigError as exc:
            if len(entries) == 1:
                raise
            hint = ("; ';' separates the URLs of a broker list, so a ';' in a password must "
                    "be percent-escaped as %3B") if str(exc).startswith("malformed") else ""
            raise ConfigError(f"broker URL {position} of {len(entries)}: {exc}{hint}") from None
        found.append((mask_url(url), parameters))
    return found



# -- what the rest of drain uses -----------------------------------------------------


def mask_url(url: str) -> str:
    """``scheme://user:secret@host/x`` -> ``scheme://user:***@host/x``, cut as kombu does.

    A URL that cannot be cut (see the module's docstring) is not shown at all.
    A broker list is masked URL by URL, its separators kept.
    """
    if ";" in url:
        parts = re.split(r"(\s*;\s*)", url)
        return "".join(part if i % 2 else _mask_one(part) for i, part in enumerate(parts))
    return _mask_one(url)


def _mask_one(url: str) -> str:
    try:
        return _cut_broker(url).cut.masked()
    except Malformed:
        return "<malformed URL, not shown>"


def mask_database_url(dsn: str) -> str:
    """Mask the secrets of a libpq URL or ``key=value`` string, cut as libpq does."""
    if not dsn:
        return "<libpq defaults (PG* variables)>"
    try:
        return cut_database(dsn).masked()
    except Malformed:
        return "<malformed database URL, not shown>"


def secrets_of(database_url: str = "", broker_url: str = "") -> list[str]:
    """The passwords of these URLs that :func:`scrub` should replace wherever they appear.

    Both as written and decoded, of malformed URLs too (what may be the
    password, cut either way); not those shorter than :data:`SCRUB_MIN_LENGTH`,
    nor those the masked URLs show anyway (a password equal to the user name).
    Never raises.
    """
    found: list[str] = []
    shown: list[str] = []
    cutters: list[tuple[Callable[[str], Cut], str]] = [(cut_database, database_url)]
    # Each URL of a broker list, and the whole text: a ';' may be in a password.
    if ";" in broker_url:
        cutters += [(_broker_cut, url) for url in _LIST_SEPARATOR.split(broker_url.strip())]
    cutters.append((_broker_cut, broker_url))
    for cutter, url in cutters:
        if not url:
            continue
        try:
            cut = cutter(url)
        except Malformed as exc:
            found += exc.secrets
            if "://" in url:  # and what the loosest cut takes for the password
                loose = url[url.index("://") + 3:url.rfind("@")]
                found += both_ways(password_of(loose)) if "@" in url else []
        except Exception:  # noqa: S112 - a URL no cutter handles has nothing to offer
            continue
        else:
            found += cut.secrets
            shown.append(cut.masked())
    return [s for s in dict.fromkeys(found)
            if len(s) >= SCRUB_MIN_LENGTH and not any(s in text for text in shown)]


def _broker_cut(url: str) -> Cut:
    return _cut_broker(url).cut


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s<>]*")
#: ``password=`` and the like in free text: a value masked already (left as it
#: is, so as not to swallow what follows it), a quoted one, or a bare word.
_SECRET_IN_TEXT = re.compile(
    r"\b(" + "|".join(sorted(SECRET_KEYWORDS)) + r")(\s*=\s*)"
    r"(\*\*\*(?=[\s&'\"]|\Z)|'(?:[^'\\]|\\.)*(?:'|\Z)|(?:[^\s\\]|\\.)*)"
)


def _mask_loose(url: str) -> str:
    """A URL found in free text, masked as its reader cuts it if it can be cut so;
    otherwise its password runs from the first ':' to the last '@'. A broker list
    is masked URL by URL."""
    if _NEXT_URL.search(url):
        return ";".join(_mask_loose(part) for part in _NEXT_URL.split(url))
    with contextlib.suppress(Malformed):
        if url.startswith(DATABASE_SCHEMES):
            return cut_database(url).masked()
        return _cut_broker(url).cut.masked()
    start = url.index("://") + 3
    at = url.rfind("@", start)
    colon = url.find(":", start, at) if at >= 0 else -1
    if colon < 0 or url.startswith(MASK + "@", colon + 1):  # none, or masked already
        return url
    return url[:colon + 1] + MASK + url[at:]


def scrub(text: str, secrets: list[str]) -> str:
    """Mask the long ``secrets``, the URLs and ``password=`` pairs in ``text``, and
    the secrets again.

    The URLs and pairs are masked by structure (see the module's docstring);
    a secret is replaced wherever it appears only when it is at least
    :data:`SCRUB_MIN_LENGTH` long. Other text is left as it is. The secrets go
    first too: a URL in free text ends at a space, so one whose password holds
    a space would otherwise be cut there and the password's tail kept.
    """
    long = sorted({s for s in secrets if len(s) >= SCRUB_MIN_LENGTH}, key=len, reverse=True)
    for secret in long:
        text = text.replace(secret, MASK)
    text = _URL_IN_TEXT.sub(lambda m: _mask_loose(m.group(0)), text)
    text = _SECRET_IN_TEXT.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    for secret in long:
        text = text.replace(secret, MASK)
    return text


class ScrubbingFormatter(logging.Formatter):
    """A log formatter that passes every line, traceback included, through :func:`scrub`."""

    def __init__(self, fmt: str, secrets: list[str]) -> None:
        super().__init__(fmt)
        self._secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record), self._secrets)


def database_conninfo(dsn: str) -> str:
    """Validate a libpq connection string or URL (empty means libpq defaults).

    A malformed one raises :class:`ConfigError` naming the part that is wrong,
    without any of its text (see the module's docstring).
    """
    if dsn:
        try:
            cut_database(dsn)
        except Malformed as exc:
            raise ConfigError(f"malformed database URL: {exc.reason}") from None
    return dsn


def broker_parameters(
    url: str, *, heartbeat: int = 30, blocked_connection_timeout: float | None = None,
    tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
) -> pika.ConnectionParameters:
    """Build pika parameters from a Celery-style broker URL.

    ``blocked_connection_timeout`` stays off for the drain: a broker in a
    resource alarm blocks every publisher, so closing and reopening the
    connection would only add a reconnect storm to its trouble (the drain waits
    for the alarm to clear instead, see ``Drain._blocked``).

    Celery users paste ``amqp://guest:guest@host:5672//``: the path after the
    first slash is the vhost, so ``//`` means the vhost ``/`` and an empty path
    means ``/`` too; ``%2F`` spellings work as well. ``amqps://`` uses TLS with
    the system's trust store, ``tls`` (Celery's ``broker_use_ssl``, see
    drain.broker.broker_options) TLS with that context whatever the scheme, checking
    the certificate against ``server_hostname`` (default: the URL's host); with
    TLS the default port is 5671. pika's own ``URLParameters`` reads ``//``
    differently, which is why this parser exists. The user name and password
    are cut as kombu cuts them (up to the authority's last ``@``); a URL that
    cannot be cut so raises :class:`ConfigError` naming what is wrong, and only
    a URL that could be cut is shown in an error (masked).
    """
    try:
        parts = _cut_broker(url)
    except Malformed as exc:
        raise ConfigError(f"malformed broker URL: {exc.reason}") from None
    shown, rest = parts.cut.masked(), parts.rest
    if rest.scheme not in ("amqp", "amqps", "pyamqp"):
        raise ConfigError(f"broker URL {shown} must start with amqp:// or amqps://")
    if not rest.hostname:
        raise ConfigError(f"broker URL {shown} names no host")
    if rest.query:
        raise ConfigError(
            f"broker URL {shown.split('?', 1)[0]}?...: query parameters are not supported"
        )
    if tls is None and rest.scheme == "amqps":
        tls = ssl.create_default_context()
    path = rest.path[1:] if rest.path.startswith("/") else rest.path
    vhost = unquote(path) if path else "/"
    credentials = pika.PlainCredentials(
        unquote(parts.username) if parts.username else "guest",
        unquote(parts.password) if parts.password else "guest",
    )
    return pika.ConnectionParameters(
        host=rest.hostname,
        port=rest.port or (5671 if tls is not None else 5672),
        virtual_host=vhost,
        credentials=credentials,
        heartbeat=heartbeat,
        blocked_connection_timeout=blocked_connection_timeout,
        connection_attempts=1,
        socket_timeout=5,
        stack_timeout=10,
        client_properties={"connection_name": f"drain@{socket.gethostname()}"},
        ssl_options=(pika.SSLOptions(tls, server_hostname or rest.hostname)
                     if tls is not None else None),
    )
