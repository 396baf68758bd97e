"""Generated URLs, most of them malformed, each holding a password: it never shows.

A seeded generator (the same cases every run) writes database URLs, libpq
``key=value`` strings and broker URLs and lists whose password is random text
with the characters URLs reserve (``@ # / ? : [ ] ' \\ ; %`` and spaces),
then mutates some of them (a reserved character inserted in or next to the
password, the tail after it cut off).
libpq and kombu parse some as meant and many not at all; whichever, the
password must not appear, nor any four characters of it, in the error, the
masked URL, a ``Settings`` repr, or (for a URL the drain accepts, the only
kind it ever logs) a log line that quotes the URL.
"""

from __future__ import annotations

import logging
import random
from urllib.parse import quote

import pytest

from drain.errors import ConfigError
from drain.settings.config import Settings
from drain.settings.urls import (
    ScrubbingFormatter,
    broker_list_parameters,
    database_conninfo,
    mask_database_url,
    mask_url,
    secrets_of,
)

#: Letters no message, host or template text here uses: a fragment with one is the password's.
LETTERS = "GHJKMNQVWYZ"
RESERVED = "@#/?:[]' \\;%="
TEMPLATES = {
    "database": [
        "postgresql://app:{s}@127.0.0.1:5432/db",
        "postgres://app:{s}@h1:5432,h2:5433/db?application_name=x",
        "postgresql://app@h/db?password={s}&sslmode=disable",
        "host=h port=5432 user=app password={s} dbname=db",
        "host=h password='{s}' user=app",
    ],
    "broker": [
        "amqp://guest:{s}@h:5672//",
        "amqps://guest:{s}@h/vhost",
        "amqp://guest:{s}@h1:5672//;amqp://guest:guest@h2//",
        "amqp://guest:guest@h1//; amqp://guest:{s}@h2:5672/v",
    ],
}


def _password(rng: random.Random, kind: str) -> str:
    chars = [rng.choice(LETTERS) for _ in range(rng.randint(6, 10))]
    # Not ';' in a broker URL: a list is split at every ';' before any URL of it
    # is read (kombu's rule), so the text before it is a URL of its own.
    reserved = RESERVED.replace(";", "") if kind == "broker" else RESERVED
    for _ in range(rng.randint(0, 3)):
        chars.insert(rng.randrange(len(chars) + 1), rng.choice(reserved))
    return "".join(chars)


def _cases(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(kind, url, password) triples."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        kind = rng.choice(sorted(TEMPLATES))
        password = _password(rng, kind)
        written = quote(password, safe="") if rng.random() < 0.2 else password
        template = rng.choice(TEMPLATES[kind])
        url = template.replace("{s}", written)
        mutation = rng.random()
        if mutation < 0.3:  # in the password or next to it
            start = template.index("{s}")
            at = rng.randint(max(0, start - 1), start + len(written))
            url = url[:at] + rng.choice(RESERVED.replace(";", "")) + url[at:]
        elif mutation < 0.4:  # after the password: cut inside it, a URL may well be
            # another valid one (amqp://u:p@ss cut to amqp://u:p@s), its tail the host
            end = template.index("{s}") + len(written) + 1
            url = url[:rng.randint(min(end, len(url)), len(url))]
        cases.append((kind, url, password))
    return cases


def _assert_hidden(password: str, text: str, where: str, url: str) -> None:
    for form in {password, quote(password, safe="")}:
        for i in range(len(form) - 3):
            fragment = form[i:i + 4]
            if any(c in LETTERS for c in fragment):
                assert fragment not in text, (
                    f"{fragment!r} of the password {password!r} in {where} of {url!r}:\n{text}")


def _log_line(url: str, secrets: list[str]) -> str:
    formatter = ScrubbingFormatter("%(levelname)s %(message)s", secrets)
    record = logging.LogRecord("drain", logging.ERROR, __file__, 1,
                               'could not connect to "%s": refused', (url,), None)
    return formatter.format(record)


@pytest.mark.parametrize("seed", range(8))
def test_generated_urls_never_show_the_password(seed: int) -> None:
    malformed = 0
    for kind, url, password in _cases(100, seed):
        shown: list[tuple[str, str]] = []
        try:
            if kind == "database":
                database_conninfo(url)
                settings = Settings(database_url=url)
            else:
                broker_list_parameters(url)
                settings = Settings(broker_url=url)
        except ConfigError as exc:
            malformed += 1
            shown.append(("the error", str(exc)))
        else:
            shown += [("repr", repr(settings)), ("describe", settings.describe())]
        if kind == "database":
            shown.append(("the masked URL", mask_database_url(url)))
            secrets = secrets_of(url)
        else:
            shown.append(("the masked URL", mask_url(url)))
            secrets = secrets_of(broker_url=url)
        if shown[0][0] != "the error":  # a refused URL is never logged, only named
            shown.append(("a log line", _log_line(url, secrets)))
        for where, text in shown:
            _assert_hidden(password, text, where, url)
    assert 0 < malformed < 100  # both paths are taken


def test_scrub_hides_a_password_with_a_space_in_a_broker_url() -> None:
    """Found by the generator: a URL in free text ends at a space, so the masking by
    structure alone cut this password there and kept its tail as the host."""
    url = "amqp://guest:H@QGMHKGQ HQ@h2:5672/v"
    broker_list_parameters(url)  # kombu reads it as meant: accepted
    _assert_hidden("H@QGMHKGQ HQ", _log_line(url, secrets_of(broker_url=url)), "a log line", url)
