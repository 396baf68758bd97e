"""Broker failover lists: Celery's ``;``-separated syntax, checked and masked URL by
URL; the order the drain tries them in; where the list comes from (--broker-url,
DRAIN_BROKER_URL, the Celery app). Pure logic: nothing connects, except one test
that knocks on closed local ports."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from celery import Celery

from drain.broker import broker_list
from drain.broker.amqp_link import AmqpLink
from drain.broker.broker_options import AppBroker, BrokerOptions
from drain.celery import celery_app
from drain.cli import main as cli
from drain.cli.common import settings_of
from drain.errors import BrokerRefused, BrokerUnavailable, ConfigError
from drain.settings import options, urls
from drain.settings.config import DEFAULT_BROKER_URL, Settings
from tests import support

A = "amqp://guest:Zq8Kx3Wv@rabbit-a:5672//"
B = "amqp://app:Vk2Qx7Wz@rabbit-b:5673/prod"
C = "amqp://ops:Tz4Kq8Wm@rabbit-c//"
A_SHOWN = "amqp://guest:***@rabbit-a:5672//"
B_SHOWN = "amqp://app:***@rabbit-b:5673/prod"
PASSWORDS = ("Zq8Kx3Wv", "Vk2Qx7Wz", "Tz4Kq8Wm")


@pytest.fixture(autouse=True)
def _no_celery_broker_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CELERY_BROKER_URL", "CELERY_BROKER_WRITE_URL", "CELERY_BROKER_READ_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def app() -> Iterator[Celery]:
    built = Celery("broker_list_test", set_as_current=False)
    yield built
    built.close()


def _hidden(text: str) -> bool:
    return not any(password in text for password in PASSWORDS)


# -- the syntax --------------------------------------------------------------------------


@pytest.mark.parametrize("text", [f"{A};{B}", f" {A} ;  {B} ", f"{A};\n{B}", [A, B], (A, B)])
def test_a_list_is_split_in_order(text: str | list[str]) -> None:
    assert urls.broker_list(text) == [A, B]


def test_a_single_url_is_a_list_of_one() -> None:
    assert urls.broker_list(A) == [A]
    assert urls.broker_list("") == [""]  # and refused as malformed, as before
    with pytest.raises(ConfigError, match=r"^malformed broker URL: it must start with amqp://"):
        urls.broker_list_parameters("")


@pytest.mark.parametrize(("text", "position"), [
    (f"{A};", "2 of 2"), (f"{A};;{B}", "2 of 3"), (f";{A}", "1 of 2"), (f"{A} ; ", "2 of 2"),
])
def test_an_empty_url_in_a_list_is_refused_by_position(text: str, position: str) -> None:
    with pytest.raises(ConfigError, match=f"broker URL {position} in the list is empty"):
        urls.broker_list_parameters(text)


def test_each_url_is_checked_and_an_error_names_its_position_masked() -> None:
    with pytest.raises(ConfigError) as caught:
        urls.broker_list_parameters(f"{A};redis://u:Sx9Wq4Kz@h:6379/0")
    assert str(caught.value) == (
        "broker URL 2 of 2: broker URL redis://u:***@h:6379/0 must start with amqp:// or amqps://")
    with pytest.raises(ConfigError) as caught:
        urls.broker_list_parameters(f"amqp://u:Wq#Zk9x@h//;{B}")
    text = str(caught.value)
    assert text.startswith("broker URL 1 of 2: malformed broker URL: '#' in the password "
                           "must be percent-escaped as %23")
    assert "%3B" in text
    assert "Zk9x" not in text and _hidden(text)


def test_a_semicolon_in_a_password_splits_the_url_as_kombu_does() -> None:
    url = "amqp://guest:Zq;Wk9xQ@rabbit//"
    with pytest.raises(ConfigError) as caught:
        urls.broker_list_parameters(url)
    text = str(caught.value)
    assert "must be percent-escaped as %3B" in text
    assert "Zq" not in text and "Wk9xQ" not in text
    assert "Zq;Wk9xQ" in urls.secrets_of(broker_url=url)
    assert "Wk9xQ" not in urls.mask_url(url)
    escaped = urls.broker_list_parameters("amqp://guest:Zq%3BWk9xQ@rabbit//")
    assert escaped[0][1].credentials.password == "Zq;Wk9xQ"


def test_a_list_is_masked_url_by_url() -> None:
    assert urls.mask_url(f"{A} ; {B}") == f"{A_SHOWN} ; {B_SHOWN}"
    assert urls.mask_url(f"{A};amqp://x:Tz4Kq8Wm@h:nope//") == (
        f"{A_SHOWN};<malformed URL, not shown>")
    assert set(urls.secrets_of(broker_url=f"{A};{B};{C}")) >= set(PASSWORDS)
    scrubbed = urls.scrub(f"could not connect to {A};{B} (x)", [])
    assert scrubbed == f"could not connect to {A_SHOWN};{B_SHOWN} (x)"
    assert _hidden(urls.scrub(f"{A};{B}; password={PASSWORDS[2]}", []))


def test_settings_keep_the_list_and_show_it_masked() -> None:
    settings = Settings(broker_url=f"{A};{B}")
    for text in (repr(settings), settings.describe()):
        assert _hidden(text)
    assert f"broker={A_SHOWN};{B_SHOWN} " in settings.describe()
    assert set(settings.secrets()) >= {"Zq8Kx3Wv", "Vk2Qx7Wz"}
    with pytest.raises(ConfigError, match=r"^broker URL 2 of 2: ") as caught:
        Settings(broker_url=f"{A};amqp://u:Wq/Zk9x@h//")
    assert "Zk9x" not in str(caught.value)


def test_no_broker_url_given_is_told_from_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRAIN_BROKER_URL", raising=False)
    args = cli.build_parser().parse_args(["run"])
    options.apply_env(args)
    assert args.broker_url is None
    settings = settings_of(args)
    assert settings.broker_url is None
    assert "broker=amqp://guest:***@127.0.0.1:5672//" in settings.describe()
    assert "broker=<the app's>" in Settings(celery_app="proj").describe()
    monkeypatch.setenv("DRAIN_BROKER_URL", f"{A};{B}")
    args = cli.build_parser().parse_args(["run"])
    assert args.broker_url == f"{A};{B}"
    args = cli.build_parser().parse_args(["run", "--broker-url", C])
    assert args.broker_url == C


def test_help_tells_of_the_list_and_what_wins(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "failover list of them separated by ';'" in text
    assert "wins over the app's broker_url and broker_write_url" in text


# -- the order ---------------------------------------------------------------------------


def _hosts(brokers: list[broker_list.Broker]) -> list[str]:
    return [b.parameters.host for b in brokers]


def test_each_url_gets_its_own_parameters() -> None:
    brokers = broker_list.build(f"{A};{B};amqp://rabbit-c")
    assert len(brokers) == 3
    assert [(b.parameters.host, b.parameters.port, b.parameters.virtual_host)
            for b in brokers.brokers] == [
        ("rabbit-a", 5672, "/"), ("rabbit-b", 5673, "prod"), ("rabbit-c", 5672, "/")]
    third = brokers.brokers[2].parameters.credentials
    assert (third.username, third.password) == ("guest", "guest")  # not the first URL's
    assert [b.shown for b in brokers.brokers][:2] == [A_SHOWN, B_SHOWN]
    assert brokers.describe() == f"{A_SHOWN};{B_SHOWN};amqp://rabbit-c (failover: round-robin)"
    assert set(brokers.secrets) >= {"Zq8Kx3Wv", "Vk2Qx7Wz"}


def test_round_robin_goes_on_with_the_next_after_the_one_that_failed() -> None:
    brokers = broker_list.build(f"{A};{B};{C}")
    first = brokers.attempts()
    assert _hosts(first) == ["rabbit-a", "rabbit-b", "rabbit-c"]
    brokers.failed(first[0])
    brokers.connected(first[1])
    assert brokers.current is first[1]
    # That connection is lost: the next pass starts after it, and wraps around.
    assert _hosts(brokers.attempts()) == ["rabbit-c", "rabbit-a", "rabbit-b"]
    # A whole pass fails: the next one starts where it began.
    for broker in brokers.attempts():
        brokers.failed(broker)
    assert _hosts(brokers.attempts()) == ["rabbit-c", "rabbit-a", "rabbit-b"]


def test_shuffle_tries_every_broker_once_per_pass_the_failed_one_last() -> None:
    built = broker_list.build(f"{A};{B};{C}")
    brokers = broker_list.BrokerList(built.brokers, strategy="shuffle", rng=random.Random(7))
    firsts = set()
    for _ in range(40):
        attempt = brokers.attempts()
        assert sorted(_hosts(attempt)) == ["rabbit-a", "rabbit-b", "rabbit-c"]
        firsts.add(attempt[0].parameters.host)
        brokers.failed(attempt[0])
        assert brokers.attempts()[-1] is attempt[0]
    assert len(firsts) == 3


def test_a_single_broker_is_a_list_of_one() -> None:
    brokers = broker_list.BrokerList.single(urls.broker_parameters(A), "shown")
    assert len(brokers) == 1 and brokers.current.shown == "shown"
    assert brokers.attempts() == [brokers.current]


def test_every_broker_is_knocked_on_while_waiting() -> None:
    brokers = broker_list.build("amqp://127.0.0.1:1//;amqp://127.0.0.1:2//")
    assert sorted(address[1][1] for address in brokers.addresses()) == [1, 2]


def test_a_pass_over_brokers_that_are_down_fails_naming_each() -> None:
    ports = [support.free_port(), support.free_port()]
    brokers = broker_list.build(";".join(
        f"amqp://guest:Zq8Kx3Wv@127.0.0.1:{port}//" for port in ports))
    link = AmqpLink(brokers, display_url="ignored", connect_timeout=5)
    with pytest.raises(BrokerUnavailable) as caught:
        link.connect()
    assert not isinstance(caught.value, BrokerRefused)
    assert str(caught.value) == "all 2 brokers failed: " + "; ".join(
        f"broker at amqp://guest:***@127.0.0.1:{port}// unreachable: connection refused"
        for port in ports)
    assert link.broker == f"amqp://guest:***@127.0.0.1:{ports[1]}//"
    assert brokers.attempts()[0].position == 1  # the next pass starts where this one did


# -- where the list comes from -----------------------------------------------------------


def test_the_apps_broker_list_is_read_without_connecting(app: Celery) -> None:
    app.conf.broker_url = f"{A};{B}"
    found = celery_app.broker_settings(app)
    assert (found.urls, found.setting, found.separate) == (f"{A};{B}", "broker_url", ())
    # Celery's own defaults (heartbeat 120 s, timeout 4 s) are not the drain's.
    assert found.options == BrokerOptions()
    app.conf.broker_url = [A, B]
    assert celery_app.broker_settings(app).urls == [A, B]


def test_broker_write_url_wins_over_broker_url(app: Celery,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    app.conf.broker_url = A
    app.conf.broker_write_url = f"{B};{C}"
    found = celery_app.broker_settings(app)
    assert (found.urls, found.setting) == (f"{B};{C}", "broker_write_url")
    monkeypatch.setenv("CELERY_BROKER_WRITE_URL", A)
    found = celery_app.broker_settings(app)
    assert (found.urls, found.setting) == (A, "CELERY_BROKER_WRITE_URL (environment)")


def test_the_apps_broker_options_are_read(app: Celery) -> None:
    app.conf.update(broker_url=A, broker_heartbeat=10, broker_connection_timeout=2.5,
                    broker_failover_strategy="shuffle", broker_login_method="AMQPLAIN",
                    broker_use_ssl={"cert_reqs": "required"})
    found = celery_app.broker_settings(app).options
    assert found == BrokerOptions(use_ssl={"cert_reqs": "required"}, login_method="AMQPLAIN",
                                  heartbeat=10, connection_timeout=2.5,
                                  failover_strategy="shuffle")


def test_a_failover_strategy_drain_cannot_follow_is_refused(app: Celery) -> None:
    def by_region(brokers: list[str]) -> Iterator[str]:
        yield from brokers

    app.conf.broker_failover_strategy = by_region
    with pytest.raises(ConfigError) as caught:
        celery_app.broker_settings(app)
    assert str(caught.value) == ("broker_failover_strategy: drain supports 'round-robin' "
                                 "(the default) and 'shuffle', not the callable by_region")


def test_the_app_gives_the_list_when_no_broker_url_is_given(app: Celery) -> None:
    app.conf.update(broker_url=f"{A};{B}", broker_heartbeat=10)
    found = broker_list.of_settings(Settings(celery_app="x"), celery_app.broker_settings(app))
    assert [b.shown for b in found.brokers] == [A_SHOWN, B_SHOWN]
    assert found.origin == "the Celery app's broker_url"
    assert all(b.parameters.heartbeat == 10 for b in found.brokers)


def test_a_given_broker_url_wins_the_apps_options_still_apply(app: Celery) -> None:
    app.conf.update(broker_url=f"{A};{B}", broker_heartbeat=10)
    found = broker_list.of_settings(Settings(celery_app="x", broker_url=C),
                                    celery_app.broker_settings(app))
    assert [b.parameters.host for b in found.brokers] == ["rabbit-c"]
    assert (found.origin, found.brokers[0].parameters.heartbeat) == ("--broker-url", 10)


def test_without_urls_anywhere_the_default_applies(app: Celery) -> None:
    for given in (None, celery_app.broker_settings(app)):
        found = broker_list.of_settings(Settings(), given)
        assert [b.shown for b in found.brokers] == [urls.mask_url(DEFAULT_BROKER_URL)]
        assert found.brokers[0].parameters.heartbeat == 30


def test_the_apps_bad_url_is_named_as_the_apps(app: Celery) -> None:
    app.conf.broker_url = f"{A};redis://u:Sx9Wq4Kz@h:6379/0"
    with pytest.raises(ConfigError) as caught:
        broker_list.of_settings(Settings(celery_app="x"), celery_app.broker_settings(app))
    assert str(caught.value) == (
        "the Celery app's broker_url: broker URL 2 of 2: broker URL redis://u:***@h:6379/0 "
        "must start with amqp:// or amqps://")


def test_broker_settings_apart_from_the_url_are_refused(app: Celery) -> None:
    app.conf.update(broker_url="amqp://rabbit//", broker_user="app", broker_password="Sx9Wq4Kz")
    found = celery_app.broker_settings(app)
    assert found.separate == ("broker_user", "broker_password")
    with pytest.raises(ConfigError, match="sets broker_user, broker_password apart") as caught:
        broker_list.of_settings(Settings(celery_app="x"), found)
    assert "Sx9Wq4Kz" not in str(caught.value)
    # --broker-url given: the app's URL settings are not used at all.
    assert len(broker_list.of_settings(Settings(celery_app="x", broker_url=A), found)) == 1


def test_app_broker_defaults() -> None:
    assert AppBroker(urls=None, setting="broker_url").options == BrokerOptions()
