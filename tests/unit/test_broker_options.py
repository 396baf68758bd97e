"""The Celery app's broker settings as pika takes them: broker_use_ssl (TLS), the
login method, the heartbeat, the connection timeout, the failover strategy.

Pure logic: nothing connects. The local RabbitMQ has no TLS listener, so TLS is
checked here, on the contexts and parameters drain builds, not end to end.
"""

from __future__ import annotations

import itertools
import shutil
import ssl
import subprocess
from pathlib import Path

import pika
import pika.credentials
import pytest

from drain.broker import broker_list
from drain.broker.amqp_link import AmqpLink
from drain.broker.broker_options import BrokerOptions, heartbeat_for
from drain.errors import BrokerUnavailable, ConfigError

URL = "amqp://app:Vk2Qx7Wz@rabbit.internal//"
SYSTEM_CAS = Path("/etc/ssl/certs/ca-certificates.crt")


def _one(url: str, options: BrokerOptions) -> pika.ConnectionParameters:
    brokers = broker_list.build(url, options)
    assert len(brokers) == 1
    return brokers.current.parameters


@pytest.fixture
def client_cert(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A self-signed certificate, its key, and the same key encrypted (openssl)."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key, encrypted = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "k-enc.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=drain-test"],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(encrypted), "-aes256",
                    "-passout", "pass:Qz7Wk2Xv"], check=True, capture_output=True)
    return cert, key, encrypted


# -- broker_use_ssl ----------------------------------------------------------------------


def test_no_tls_unless_asked() -> None:
    assert BrokerOptions().tls() is None
    assert _one(URL, BrokerOptions()).ssl_options is None
    assert _one(URL, BrokerOptions()).port == 5672


def test_use_ssl_true_is_tls_checking_the_certificate_and_host_name() -> None:
    options = BrokerOptions.of(use_ssl=True)
    context = options.tls()
    assert context is not None
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, True)
    parameters = _one(URL, options)
    assert parameters.ssl_options is not None
    assert parameters.ssl_options.server_hostname == "rabbit.internal"
    assert parameters.port == 5671  # TLS without a port in the URL
    assert _one("amqp://rabbit.internal:5999//", options).port == 5999


def test_amqps_urls_use_tls_with_or_without_options() -> None:
    plain = _one("amqps://rabbit.internal//", BrokerOptions())
    assert plain.ssl_options is not None and plain.port == 5671
    options = BrokerOptions.of(use_ssl={"cert_reqs": ssl.CERT_NONE})
    relaxed = _one("amqps://rabbit.internal//", options)
    assert relaxed.ssl_options is not None
    assert relaxed.ssl_options.context.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(("cert_reqs", "mode", "hostname"), [
    (ssl.CERT_NONE, ssl.CERT_NONE, False),
    (0, ssl.CERT_NONE, False),
    ("CERT_NONE", ssl.CERT_NONE, False),
    (ssl.CERT_OPTIONAL, ssl.CERT_OPTIONAL, True),
    ("required", ssl.CERT_REQUIRED, True),
    (ssl.CERT_REQUIRED, ssl.CERT_REQUIRED, True),
])
def test_cert_reqs(cert_reqs: object, mode: ssl.VerifyMode, hostname: bool) -> None:
    context = BrokerOptions.of(use_ssl={"cert_reqs": cert_reqs}).tls()
    assert context is not None
    assert (context.verify_mode, context.check_hostname) == (mode, hostname)


def test_server_hostname_is_checked_instead_of_the_urls_host() -> None:
    options = BrokerOptions.of(use_ssl={"server_hostname": "rabbit.example.com"})
    for parameters in (broker.parameters for broker in broker_list.build(
            "amqp://10.0.0.1//;amqp://10.0.0.2//", options).brokers):
        assert parameters.ssl_options is not None
        assert parameters.ssl_options.server_hostname == "rabbit.example.com"


@pytest.mark.skipif(not SYSTEM_CAS.exists(), reason="no system CA bundle here")
def test_ca_certs_are_loaded() -> None:
    context = BrokerOptions.of(use_ssl={"ca_certs": str(SYSTEM_CAS)}).tls()
    assert context is not None and context.cert_store_stats()["x509_ca"] > 0


def test_a_client_certificate_is_loaded(client_cert: tuple[Path, Path, Path]) -> None:
    cert, key, _ = client_cert
    options = BrokerOptions.of(use_ssl={"certfile": str(cert), "keyfile": str(key)})
    assert options.tls() is not None
    assert BrokerOptions.of(use_ssl={"certfile": cert, "keyfile": key}).tls() is not None


def test_an_encrypted_key_is_refused_not_prompted_for(
        client_cert: tuple[Path, Path, Path]) -> None:
    cert, _, encrypted = client_cert
    options = BrokerOptions.of(use_ssl={"certfile": str(cert), "keyfile": str(encrypted)})
    with pytest.raises(ConfigError, match=f"the key in {encrypted} is encrypted"):
        options.tls()


@pytest.mark.parametrize(("value", "message"), [
    ({"ssl_version": 2}, "drain does not support ssl_version; it supports keyfile, certfile, "
     "ca_certs, cert_reqs, server_hostname, ciphers"),
    ({"keyfile": "/k.pem"}, "keyfile needs certfile"),
    ({"cert_reqs": "sometimes"}, "cert_reqs must be ssl.CERT_NONE, ssl.CERT_OPTIONAL or"),
    ({"cert_reqs": 7}, "cert_reqs must be"),
    ({"ca_certs": 5}, "ca_certs must be a string"),
    ("yes", "broker_use_ssl must be True, False or a dict"),
    (ssl.create_default_context(), "not SSLContext"),
])
def test_tls_options_drain_cannot_honour_are_refused(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match="broker_use_ssl") as caught:
        BrokerOptions.of(use_ssl=value)
    assert message in str(caught.value)


@pytest.mark.parametrize(("value", "message"), [
    ({"ca_certs": "/nonexistent/ca.pem"},
     "broker_use_ssl: cannot read ca_certs /nonexistent/ca.pem: No such file or directory"),
    ({"certfile": "/nonexistent/c.pem"},
     "broker_use_ssl: cannot load certfile /nonexistent/c.pem: No such file or directory"),
    ({"ciphers": "NO-SUCH-CIPHER"}, "broker_use_ssl: no cipher matches ciphers 'NO-SUCH-CIPHER'"),
])
def test_files_and_ciphers_that_cannot_be_used_are_refused_at_start(
        value: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        broker_list.build(URL, BrokerOptions.of(use_ssl=value))
    assert str(caught.value) == message


# -- broker_login_method -----------------------------------------------------------------


@pytest.mark.parametrize("method", [None, "AMQPLAIN", "PLAIN", "amqplain"])
def test_plain_logins_use_the_urls_user_and_password(method: str | None) -> None:
    credentials = _one(URL, BrokerOptions.of(login_method=method)).credentials
    assert isinstance(credentials, pika.PlainCredentials)
    assert (credentials.username, credentials.password) == ("app", "Vk2Qx7Wz")


@pytest.mark.parametrize("url", ["amqps://rabbit.internal//", "amqp://rabbit.internal//"])
def test_external_login_uses_the_client_certificate(url: str) -> None:
    options = BrokerOptions.of(login_method="EXTERNAL", use_ssl=url.startswith("amqp:"))
    credentials = _one(url, options).credentials
    assert isinstance(credentials, pika.credentials.ExternalCredentials)


def test_external_login_without_tls_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        broker_list.build(URL, BrokerOptions.of(login_method="EXTERNAL"))
    assert str(caught.value) == (
        "broker_login_method EXTERNAL logs in with a TLS client certificate, but broker URL "
        "amqp://app:***@rabbit.internal// uses no TLS: use amqps:// or broker_use_ssl")


def test_other_login_methods_are_refused() -> None:
    with pytest.raises(ConfigError, match="broker_login_method 'GSSAPI': drain logs in with "
                       "PLAIN"):
        BrokerOptions.of(login_method="GSSAPI")


# -- heartbeat, timeout, strategy --------------------------------------------------------


@pytest.mark.parametrize(("value", "heartbeat"),
                         [(None, 30), (10, 10), (0, 30), (2.5, 3), (60, 60), (120, 60)])
def test_heartbeat(value: float | None, heartbeat: int) -> None:
    """Never off (a blocked broker that dies silently is noticed only by the
    heartbeat: issue 24, item 6), at most 60 s."""
    assert _one(URL, BrokerOptions.of(heartbeat=value)).heartbeat == heartbeat


@pytest.mark.parametrize(("value", "heartbeat"), [(None, 2), (0, 2), (10, 10), (600, 60)])
def test_the_drains_own_heartbeat_replaces_none_or_0(value: int | None, heartbeat: int) -> None:
    assert heartbeat_for(value, 2) == heartbeat
    found = broker_list.build(URL, BrokerOptions.of(heartbeat=value), heartbeat=2)
    assert found.current.parameters.heartbeat == heartbeat


def test_a_block_ends_with_its_connection() -> None:
    """drain_broker_blocked reads AmqpLink.blocked: a lost connection unblocks it,
    and the loss says how long the broker had blocked it."""
    link = AmqpLink(broker_list.build(URL), display_url="")
    link._set_blocked("low on memory")
    link._on_connection_closed(None, OSError(0, "connection lost"))
    assert link.blocked is None
    with pytest.raises(BrokerUnavailable, match=r"connection lost \(it had blocked publishing"):
        link._raise_if_failed()
    link._set_blocked("low on memory")
    link.close()
    assert link.blocked is None


def test_connection_timeout_bounds_the_connect_and_the_handshake() -> None:
    default = _one(URL, BrokerOptions())
    assert (default.socket_timeout, default.stack_timeout) == (5, 10)
    parameters = _one(URL, BrokerOptions.of(connection_timeout=2.5))
    assert (parameters.socket_timeout, parameters.stack_timeout) == (2.5, 2.5)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("heartbeat", -1, "broker_heartbeat must be 0 (none) or a number of seconds, not -1"),
    ("heartbeat", "often", "broker_heartbeat must be"),
    ("heartbeat", True, "broker_heartbeat must be"),
    ("connection_timeout", 0, "broker_connection_timeout must be a positive number"),
    ("connection_timeout", float("nan"), "broker_connection_timeout must be"),
])
def test_bad_numbers_are_refused(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        BrokerOptions.of(**{key: value})


@pytest.mark.parametrize(("value", "strategy"), [
    (None, "round-robin"), ("round-robin", "round-robin"), ("shuffle", "shuffle"),
    ("Shuffle", "shuffle"),
])
def test_failover_strategies(value: str | None, strategy: str) -> None:
    options = BrokerOptions.of(failover_strategy=value)
    assert options.failover_strategy == strategy
    brokers = broker_list.build(f"{URL};amqp://other//", options)
    assert brokers.strategy == strategy


@pytest.mark.parametrize(("value", "shown"), [
    ("priority", "'priority'"), (itertools.cycle, "the callable cycle"), (3, "3"),
])
def test_other_failover_strategies_are_refused(value: object, shown: str) -> None:
    with pytest.raises(ConfigError) as caught:
        BrokerOptions.of(failover_strategy=value)
    assert str(caught.value) == (
        "broker_failover_strategy: drain supports 'round-robin' (the default) and 'shuffle', "
        f"not {shown}")


def test_what_differs_from_the_drains_defaults_is_described() -> None:
    assert BrokerOptions().describe() == ""
    options = BrokerOptions.of(use_ssl=True, login_method="EXTERNAL", heartbeat=10,
                               connection_timeout=2)
    assert options.describe() == ("TLS (broker_use_ssl), login EXTERNAL, heartbeat 10s, "
                                  "connection timeout 2s")
    assert BrokerOptions.of(heartbeat=0).describe(5) == (
        "heartbeat 5s (not the app's broker_heartbeat 0: never off, at most 60s)")
