"""Settings, URL parsing and secret masking (pure logic)."""

from __future__ import annotations

import pytest

from drain.config import (
    Settings,
    broker_parameters,
    mask_database_url,
    mask_url,
    scrub,
)
from drain.dead import format_duration, parse_duration
from drain.errors import ConfigError


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
    ("field", "value", "fragment"),
    [
        ("batch_size", 0, "batch size"),
        ("poll_interval", 0, "poll interval"),
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
