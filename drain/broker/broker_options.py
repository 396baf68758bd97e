"""How the drain reaches its brokers beyond their URLs: the Celery app's broker settings.

With ``drain run --app``, these settings of the app apply to every broker the
drain connects to, whether the URLs come from the app or from
``--broker-url`` (which, like ``celery -b``, overrides only the URLs):

* ``broker_use_ssl``: ``True`` is TLS with the system's trust store; a dict
  of py-amqp's TLS options (:data:`SSL_KEYS`: ``keyfile``, ``certfile``,
  ``ca_certs``, ``cert_reqs``, ``server_hostname``, ``ciphers``) becomes one
  :class:`ssl.SSLContext`. The certificate's host name is always checked while
  certificates are checked (against ``server_hostname``, else the URL's host),
  which py-amqp does only when ``server_hostname`` is given; ``cert_reqs``
  ``CERT_NONE`` checks nothing. Without a port, a URL with TLS goes to 5671.
* ``broker_login_method``: ``AMQPLAIN`` (kombu's default) and ``PLAIN`` log
  in with the URL's user name and password (pika has no AMQPLAIN: it sends
  them as PLAIN, which RabbitMQ accepts unless its ``auth_mechanisms`` were
  narrowed); ``EXTERNAL`` logs in with the TLS client certificate (pika's
  ``ExternalCredentials``) and needs TLS.
* ``broker_heartbeat`` and ``broker_connection_timeout``, only where the app
  sets them (drain.celery.celery_app): Celery's defaults (120 s, which only its
  workers use; 4 s) do not replace the drain's own (a 30 s heartbeat,
  ``DRAIN_BROKER_HEARTBEAT``; 5 s to open the TCP connection, 10 s for it, TLS
  and the AMQP handshake). The app's timeout bounds both. The heartbeat is
  never off and at most :data:`MAX_HEARTBEAT` (:func:`heartbeat_for`): the
  drain keeps its connection while the broker blocks it (a resource alarm),
  and only the heartbeat tells a blocked broker from one that died silently.
* ``broker_failover_strategy``: ``round-robin`` (the default) or ``shuffle``
  (drain.broker.broker_list says what each does). Anything else, a callable or an
  iterator factory of kombu's, is refused.

Every value is checked when the drain starts: one that drain cannot honour is a
:class:`ConfigError` (exit code 2) naming the setting, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
import ssl
from collections.abc import Mapping
from typing import Any

import pika
import pika.credentials

from drain.errors import ConfigError
from drain.settings import config

#: broker_use_ssl's keys that drain maps (py-amqp's names).
SSL_KEYS = ("keyfile", "certfile", "ca_certs", "cert_reqs", "server_hostname", "ciphers")
#: broker_failover_strategy's values that drain supports; the first is the default.
STRATEGIES = ("round-robin", "shuffle")
#: broker_login_method's values that drain supports.
LOGIN_METHODS = ("AMQPLAIN", "PLAIN", "EXTERNAL")
#: The drain's heartbeat when the app sets none or 0 (seconds; --broker-heartbeat).
DEFAULT_HEARTBEAT = config.DEFAULT_HEARTBEAT
#: The longest heartbeat the drain negotiates, whatever the app sets (seconds).
MAX_HEARTBEAT = config.MAX_HEARTBEAT
#: cert_reqs as ssl's constants or their names (Celery's Redis settings spell them so too).
_CERT_REQS = {
    "none": ssl.CERT_NONE, "cert_none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL, "cert_optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED, "cert_required": ssl.CERT_REQUIRED,
}


class _EncryptedKey(Exception):
    """The TLS key file asks for a password."""


@dataclasses.dataclass(frozen=True)
class BrokerOptions:
    """How to reach the brokers beyond their URLs; the defaults are the drain's own."""

    #: broker_use_ssl: False, True, or the dict of TLS options (:data:`SSL_KEYS`).
    use_ssl: bool | Mapping[str, Any] = False
    #: broker_login_method, upper case; None: the URL's user name and password.
    login_method: str | None = None
    #: broker_heartbeat in whole seconds (0: none); None: :data:`DEFAULT_HEARTBEAT`.
    heartbeat: int | None = None
    #: broker_connection_timeout in seconds; None: pika's 5 s / 10 s as drain sets them.
    connection_timeout: float | None = None
    #: broker_failover_strategy, one of :data:`STRATEGIES`.
    failover_strategy: str = STRATEGIES[0]

    @classmethod
    def of(
        cls, *, use_ssl: Any = False, login_method: Any = None, heartbeat: Any = None,
        connection_timeout: Any = None, failover_strategy: Any = None,
    ) -> BrokerOptions:
        """The options the values of a Celery app's settings ask for (None: not set).

        Raises :class:`ConfigError` naming the setting for a value drain cannot
        honour. Files named by ``broker_use_ssl`` are read by :meth:`tls`.
        """
        return cls(
            use_ssl=_use_ssl(use_ssl),
            login_method=_login_method(login_method),
            heartbeat=_heartbeat(heartbeat),
            connection_timeout=_timeout(connection_timeout),
            failover_strategy=_strategy(failover_strategy),
        )

    @property
    def server_hostname(self) -> str | None:
        """The host name the broker's certificate must carry (None: each URL's host)."""
        if isinstance(self.use_ssl, Mapping):
            name = self.use_ssl.get("server_hostname")
            return str(name) if name else None
        return None

    def tls(self) -> ssl.SSLContext | None:
        """The TLS context broker_use_ssl asks for; None when it asks for none
        (``amqps://`` URLs still use TLS, with the system's trust store).

        Reads the files it names now: one that cannot be read is a
        :class:`ConfigError` naming the option and the file.
        """
        if self.use_ssl is False:
            return None
        options: Mapping[str, Any] = {} if self.use_ssl is True else self.use_ssl
        cafile = options.get("ca_certs")
        try:
            context = ssl.create_default_context(cafile=cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"broker_use_ssl: cannot read ca_certs {cafile}: "
                              f"{_reason(exc)}") from None
        certfile, keyfile = options.get("certfile"), options.get("keyfile")
        if certfile:
            try:
                context.load_cert_chain(certfile, keyfile, password=_no_password)
            except _EncryptedKey:
                raise ConfigError(
                    f"broker_use_ssl: the key in {keyfile or certfile} is encrypted; drain "
                    "cannot ask for its password: give it an unencrypted key file") from None
            except (OSError, ssl.SSLError) as exc:
                files = f"certfile {certfile}" + (f" and keyfile {keyfile}" if keyfile else "")
                raise ConfigError(f"broker_use_ssl: cannot load {files}: {_reason(exc)}") from None
        mode = options.get("cert_reqs")
        if mode is not None:
            verify = _verify_mode(mode)
            if verify == ssl.CERT_NONE:
                context.check_hostname = False
            context.verify_mode = verify
        ciphers = options.get("ciphers")
        if ciphers:
            try:
                context.set_ciphers(str(ciphers))
            except ssl.SSLError:
                raise ConfigError(
                    f"broker_use_ssl: no cipher matches ciphers {ciphers!r}") from None
        return context

    def configure(self, parameters: pika.ConnectionParameters, shown: str) -> None:
        """Apply the login method and the timeout to one broker's ``parameters``
        (``shown``: its masked URL, for the error of EXTERNAL without TLS)."""
        if self.login_method == "EXTERNAL":
            if parameters.ssl_options is None:
                raise ConfigError(
                    f"broker_login_method EXTERNAL logs in with a TLS client certificate, but "
                    f"broker URL {shown} uses no TLS: use amqps:// or broker_use_ssl")
            parameters.credentials = pika.credentials.ExternalCredentials()
        if self.connection_timeout is not None:
            parameters.socket_timeout = self.connection_timeout
            parameters.stack_timeout = self.connection_timeout

    def describe(self, own: int = DEFAULT_HEARTBEAT) -> str:
        """What differs from the drain's defaults, for the start-up log ("" when nothing);
        ``own``: the drain's heartbeat (:func:`heartbeat_for`)."""
        parts = []
        if self.use_ssl is not False:
            parts.append("TLS (broker_use_ssl)")
        if self.login_method == "EXTERNAL":
            parts.append("login EXTERNAL")
        if self.heartbeat is not None:
            used = heartbeat_for(self.heartbeat, own)
            parts.append(f"heartbeat {used}s" if used == self.heartbeat else
                         f"heartbeat {used}s (not the app's broker_heartbeat {self.heartbeat}: "
                         f"never off, at most {MAX_HEARTBEAT}s)")
        if self.connection_timeout is not None:
            parts.append(f"connection timeout {self.connection_timeout:g}s")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class AppBroker:
    """What a Celery app's configuration says about its broker (drain.celery.celery_app)."""

    #: The URLs its ``connection_for_write`` would use: a ``;``-separated string,
    #: a list, or None (none set).
    urls: str | list[str] | None
    #: The setting (or environment variable) they come from, for messages.
    setting: str
    options: BrokerOptions = dataclasses.field(default_factory=BrokerOptions)
    #: broker_user, broker_port... set apart from the URL: drain does not read them.
    separate: tuple[str, ...] = ()


def _use_ssl(value: Any) -> bool | Mapping[str, Any]:
    if value is None or isinstance(value, bool):
        return bool(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"broker_use_ssl must be True, False or a dict of TLS options "
                          f"({', '.join(SSL_KEYS)}), not {type(value).__name__}")
    unknown = sorted(str(key) for key in value if key not in SSL_KEYS)
    if unknown:
        raise ConfigError(f"broker_use_ssl: drain does not support {', '.join(unknown)}; it "
                          f"supports {', '.join(SSL_KEYS)}")
    for key in ("keyfile", "certfile", "ca_certs", "server_hostname", "ciphers"):
        item = value.get(key)
        if item is not None and not isinstance(item, (str, os.PathLike)):
            raise ConfigError(f"broker_use_ssl: {key} must be a string, "
                              f"not {type(item).__name__}")
    if value.get("keyfile") and not value.get("certfile"):
        raise ConfigError("broker_use_ssl: keyfile needs certfile (the client certificate)")
    if value.get("cert_reqs") is not None:
        _verify_mode(value["cert_reqs"])
    return dict(value)


def _verify_mode(value: Any) -> ssl.VerifyMode:
    if isinstance(value, str) and value.strip().lower() in _CERT_REQS:
        return _CERT_REQS[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return ssl.VerifyMode(value)
        except ValueError:
            pass
    raise ConfigError(f"broker_use_ssl: cert_reqs must be ssl.CERT_NONE, ssl.CERT_OPTIONAL or "
                      f"ssl.CERT_REQUIRED, not {value!r}")


def _login_method(value: Any) -> str | None:
    if value is None:
        return None
    method = str(value).strip().upper()
    if method not in LOGIN_METHODS:
        raise ConfigError(f"broker_login_method {value!r}: drain logs in with PLAIN (AMQPLAIN "
                          "and PLAIN: the URL's user name and password) or EXTERNAL (a TLS "
                          "client certificate)")
    return method


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def heartbeat_for(app_setting: int | None, own: int = DEFAULT_HEARTBEAT) -> int:
    """The heartbeat (seconds) the drain asks for, given the app's ``broker_heartbeat``
    (None: not set) and its own (``--broker-heartbeat``).

    Never off: the drain waits on a broker that blocks it (a resource alarm)
    without a time limit, and a broker that then dies without closing the
    connection (a host gone, a silent network cut) is noticed only by missing
    heartbeats, within 2 x (heartbeat + 5) s (pika checks every heartbeat + 5
    s). So the app's 0 (none) or unset is the drain's own, and a longer one is
    cut to :data:`MAX_HEARTBEAT`.
    """
    if not app_setting:
        return own
    return min(app_setting, MAX_HEARTBEAT)


def _heartbeat(value: Any) -> int | None:
    if value is None:
        return None
    number = _number(value)
    if number is None or number < 0:
        raise ConfigError(f"broker_heartbeat must be 0 (none) or a number of seconds, "
                          f"not {value!r}")
    return math.ceil(number)


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    number = _number(value)
    if number is None or number <= 0:
        raise ConfigError(f"broker_connection_timeout must be a positive number of seconds, "
                          f"not {value!r}")
    return number


def _strategy(value: Any) -> str:
    if value is None:
        return STRATEGIES[0]
    if isinstance(value, str) and value.strip().lower() in STRATEGIES:
        return value.strip().lower()
    what = (f"the callable {getattr(value, '__name__', type(value).__name__)}"
            if callable(value) else repr(value))
    raise ConfigError(f"broker_failover_strategy: drain supports 'round-robin' (the default) "
                      f"and 'shuffle', not {what}")


def _no_password() -> bytes:
    """The password callback for the TLS key: drain has none to give."""
    raise _EncryptedKey


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
