"""Settings, URL parsing and secret masking (pure logic)."""

from __future__ import annotations

import logging
import sys

import pytest

from drain.cli import main as cli
from drain.errors import ConfigError
from drain.postgres.dead import format_duration, parse_duration
from drain.settings.config import Settings
from drain.settings.urls import (
    ScrubbingFormatter,
    broker_parameters,
    database_conninfo,
    mask_database_url,
    mask_url,
    scrub,
    secrets_of,
)


@pytest.mark.parametrize(
    ("url", "vhost"),
    [
        ("amqp://guest:guest@127.0.0.1:5672//", "/"),  # Celery's spelling of the default vhost
        ("amqp://guest:guest@127.0.0.1:5672/", "/"),
        ("amqp://guest:guest@127.0.0.1:5672", "/"),
        ("amqp://guest:guest@127.0.0.1:5672/%2F", "/"),
        ("amqp://guest:guest@127.0.0.1:5672/prod", "prod"),
        ("amqp://guest:guest@127.0.0.1:5672/a%2Fb", "a/b"),
    ],
)
def test_broker_vhost(url: str, vhost: str) -> None:
    assert broker_parameters(url).virtual_host == vhost


def test_broker_credentials_and_port() -> None:
    p = broker_parameters("amqp://us%40er:p%3Ass@rabbit.example:5673//")
    assert (p.host, p.port) == ("rabbit.example", 5673)
    assert (p.credentials.username, p.credentials.password) == ("us@er", "p:ss")
    assert broker_parameters("amqps://h//").port == 5671


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://localhost:6379/0", "must start with amqp://"),
        ("amqp:///vhost", "names no host"),
        ("amqp://h:notaport//", "malformed"),
        ("amqp://h//?heartbeat=5", "query parameters"),
    ],
)
def test_bad_broker_urls(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        broker_parameters(url)


def test_masking() -> None:
    assert mask_url("amqp://guest:s3cret@h:5672//") == "amqp://guest:***@h:5672//"
    assert mask_url("amqp://h//") == "amqp://h//"
    assert mask_database_url("postgresql://app:s3cret@db/x") == "postgresql://app:***@db/x"
    assert mask_database_url("host=db password=s3cret user=app") == "host=db password=*** user=app"
    assert mask_database_url("host=db password='s3 cret' user=app") == (
        "host=db password=*** user=app"
    )
    assert "PG" in mask_database_url("")


def test_settings_never_show_passwords() -> None:
    s = Settings(
        database_url="postgresql://app:dbpass@127.0.0.1/x",
        broker_url="amqp://guest:brokerpass@127.0.0.1//",
    )
    for text in (repr(s), str(s), s.describe()):
        assert "dbpass" not in text
        assert "brokerpass" not in text
    assert set(s.secrets()) >= {"dbpass", "brokerpass"}
    assert scrub("failed for brokerpass and dbpass", s.secrets()) == "failed for *** and ***"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        # One-letter passwords: only the password's characters are masked.
        ("postgresql://app:a@a.example/a", "postgresql://app:***@a.example/a"),
        ("postgresql://postgres:1@127.0.0.1:5431/d1", "postgresql://postgres:***@127.0.0.1:5431/d1"),
        ("host=a user=a password=a dbname=a", "host=a user=a password=*** dbname=a"),
        # libpq reads ':', '?', '#' and '[' in a password as written.
        ("postgresql://app:p:s?s#w[@h/db", "postgresql://app:***@h/db"),
        ("postgresql://app:pw@h/db?sslpassword=x&password=y&application_name=me@work",
         "postgresql://app:***@h/db?sslpassword=***&password=***&application_name=me@work"),
        ("postgresql://app@h1:5432,h2:5433/db", "postgresql://app@h1:5432,h2:5433/db"),
        ("host=h password = 'a b\\' c' user=app", "host=h password = *** user=app"),
        ("host=h password=a\\ b user=app sslpassword='x'",
         "host=h password=*** user=app sslpassword=***"),
        ("password=", "password=***"),
    ],
)
def test_database_urls_are_masked_by_structure(url: str, masked: str) -> None:
    assert database_conninfo(url) == url
    assert mask_database_url(url) == masked


@pytest.mark.parametrize(
    ("url", "masked", "password"),
    [
        ("amqp://guest:g@g.example:5672/g", "amqp://guest:***@g.example:5672/g", "g"),
        # kombu and urllib cut at the authority's last '@': so does drain.
        ("amqp://guest:p@ss:w@h//", "amqp://guest:***@h//", "p@ss:w"),
        ("amqp://guest:p%2Fs%23s@h//", "amqp://guest:***@h//", "p/s#s"),
        ("amqp://guest:@h//", "amqp://guest:***@h//", None),
    ],
)
def test_broker_urls_are_masked_by_structure(url: str, masked: str, password: str | None) -> None:
    assert mask_url(url) == masked
    assert broker_parameters(url).credentials.password == (password or "guest")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://app:Qz9@x#y/Qz9@127.0.0.1/db",
         "'@' and '/' in the password must be percent-escaped as %40 and %2F"),
        ("postgresql://app:Qz9/Qz9@127.0.0.1:5432/db", "'/' in the password must be"),
        ("postgresql://me@corp:Qz9@h/db", "'@' in the user name must be percent-escaped as %40"),
        ("postgresql://Qz9/my@db", "or, if the '@' belongs to the database name, write it as %40"),
        ("postgresql://app:100%Qz9@h/db", "the password has a '%' that does not start"),
        ("postgresql://app:Qz9 Qz9@h/db", "the password contains a space"),
        ("postgresql://app:Qz9@h:notaport/db", "the port is not a number"),
        ("postgresql://app:Qz9@h:99999/db", "the port is out of range"),
        ("postgresql://app:Qz9@[::1/db", "the IPv6 address has no closing ']'"),
        ("postgresql://app:Qz9@h/db?passwd=Qz9", "the 1st query parameter is not a libpq"),
        ("postgresql://app:Qz9@h/db?Qz9", "the 1st query parameter has no '='"),
        ("postgresql+psycopg2://app:Qz9@h/db", "not postgresql+psycopg2://"),
        ("Postgresql://app:Qz9@h/db", "libpq's are lower case"),
        ("host=h password='Qz9 Qz9 user=app", "the value of password has no closing quote"),
        ("host=h password=Qz9 Qz9 user=app", "the 3rd item after the value of password has no '='"),
        ("host=h password=Qz9 Qz9=x", "the 3rd item is not a libpq connection parameter"),
        ("host=h Password=Qz9", "libpq's are lower case: password"),
        ("Qz9 Qz9", "neither a postgresql:// URL nor key=value pairs"),
    ],
)
def test_malformed_database_urls_name_the_part_not_the_text(url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        database_conninfo(url)
    message = str(caught.value)
    assert message.startswith("malformed database URL: ")
    assert reason in message
    assert "Qz9" not in message and "corp" not in message and "@h" not in message
    assert "not shown" in mask_database_url(url)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("amqp://guest:a@b/c#d@127.0.0.1//", "'/' and '#' in the password must be percent-escaped"),
        ("amqp://guest:Qz9#Qz9@h//", "'#' in the password must be percent-escaped as %23"),
        ("amqp://guest:Qz9?Qz9@h//", "'?' in the password must be percent-escaped as %3F"),
        ("amqp://guest:Qz9[Qz9@h//", "'[' in the password must be percent-escaped as %5B"),
        ("amqp://guest:Qz9@h:5x//", "the port is not a number"),
        ("amqp://guest:Qz9@h:70000//", "the port is out of range"),
        ("guest:Qz9@h", "it must start with amqp:// or amqps://"),
    ],
)
def test_malformed_broker_urls_name_the_part_not_the_text(url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        broker_parameters(url)
    message = str(caught.value)
    assert message.startswith("malformed broker URL: ") and reason in message
    for fragment in ("Qz9", "b/c", "c#d", "://guest", "@h"):
        assert fragment not in message
    assert "not shown" in mask_url(url)


def test_scrub_masks_urls_and_pairs_by_structure_and_only_long_secrets() -> None:
    # A one-letter password is not searched for: nothing else is mangled.
    s = Settings(database_url="postgresql://app:a@127.0.0.1/db")
    assert s.secrets() == []
    text = 'database postgresql://app:***@127.0.0.1/db unreachable: "a"'
    assert scrub(text, s.secrets()) == text
    # URLs and password= pairs in free text, whatever the password.
    assert scrub('at "postgresql://u:p@ss/w@h/db" (x)', []) == 'at "postgresql://u:***@h/db" (x)'
    assert scrub("amqp://guest:x@h// and password='a b' c", []) == (
        "amqp://guest:***@h// and password=*** c")
    assert scrub("failed: password authentication failed", []) == (
        "failed: password authentication failed")
    # Masked text stays as it is, query and all.
    shown = "postgresql://app:***@h/db?password=***&application_name=me@work x"
    assert scrub(shown, ["hunter22"]) == shown
    # A password equal to the user name is shown as the user name is, not scrubbed.
    assert secrets_of("postgresql://postgres:postgres@h/db") == []
    assert secrets_of("", "amqp://guest:hunter22@h//") == ["hunter22"]
    assert scrub("refused hunter22 and hunter2", ["hunter22", "hunter2"]) == (
        "refused *** and ***")


@pytest.mark.parametrize("url", ["postgresql://[", "amqp://[", "host='", "a=b=c", "://", "@:/"])
def test_secrets_of_never_raises(url: str) -> None:
    assert isinstance(secrets_of(url, url), list)


def test_the_log_formatter_scrubs_messages_and_tracebacks() -> None:
    formatter = ScrubbingFormatter("%(levelname)s %(message)s", ["hunter22"])

    def fail() -> None:
        raise ValueError("could not use postgresql://app:s3cr#t@h/db with hunter22")

    try:
        fail()
    except ValueError:
        record = logging.LogRecord("drain", logging.ERROR, __file__, 1,
                                   "failed: %s", ("amqp://guest:p@w@h//",), sys.exc_info())
    text = formatter.format(record)
    assert "ERROR failed: amqp://guest:***@h//" in text
    assert "postgresql://app:***@h/db with ***" in text
    assert "s3cr" not in text and "hunter22" not in text and "p@w" not in text


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("batch_size", 0, "batch size"),
        ("pipeline", 0, "pipeline"),
        ("pipeline", 17, "pipeline"),
        ("poll_interval", 0, "poll interval"),
        ("poll_interval", float("nan"), "poll interval"),
        ("confirm_timeout", float("inf"), "confirm timeout"),
        ("rescan_interval", float("nan"), "rescan interval"),
        ("lock_key", 2**63, "lock key"),
        ("queue_declare", "loud", "queue declare"),
        ("database_url", "host=x port", "malformed database URL"),
    ],
)
def test_settings_validation(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        Settings(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "seconds", "spelled"),
    [("90", 90, "90s"), ("90s", 90, "90s"), ("15m", 900, "15m"), ("12h", 43200, "12h"),
     ("7d", 604800, "7d"), ("2w", 1209600, "14d"), ("1.5s", 1.5, "1.5s"), ("0s", 0, "0s")],
)
def test_durations(text: str, seconds: float, spelled: str) -> None:
    value = parse_duration(text)
    assert value.total_seconds() == seconds
    assert format_duration(value) == spelled
    assert parse_duration(format_duration(value)) == value


@pytest.mark.parametrize("text", ["", "soon", "5y", "-3d", "1 2"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ConfigError, match="not a duration"):
        parse_duration(text)


def test_app_settings() -> None:
    assert "app=proj.celery:app" in Settings(celery_app="proj.celery:app").describe()
    with pytest.raises(ConfigError, match="does not go with --app"):
        Settings(celery_app="proj", queue_max_priority=10)
    with pytest.raises(ConfigError, match="needs --app"):
        Settings(allow_unknown_tasks=True)


def test_run_parser_reads_the_app_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAIN_CELERY_APP", "proj")
    args = cli.build_parser().parse_args(["run"])
    assert (args.celery_app, args.allow_unknown_tasks) == ("proj", False)
    args = cli.build_parser().parse_args(["run", "--app", "other:app", "--allow-unknown-tasks"])
    assert (args.celery_app, args.allow_unknown_tasks) == ("other:app", True)
