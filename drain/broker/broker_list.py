"""Which brokers the drain publishes through, and in which order it tries them.

The broker URL may be a failover list, as Celery's ``broker_url`` takes it
(``amqp://a//;amqp://b//``, see drain.settings.urls). Where the list comes from
(:func:`of_settings`): ``--broker-url`` / ``DRAIN_BROKER_URL`` when given,
which wins; else, with ``--app``, the app's ``broker_write_url`` or
``broker_url``; else the default. With ``--app``, the app's other broker
settings (drain.broker.broker_options) apply to every URL of the list either way.

Connecting (:meth:`drain.broker.amqp_link.AmqpLink.connect`) is one pass over the
list: each broker is tried once, in the order below, without waiting between
them, and the first that lets the drain in is used. Only when every broker of
the pass failed does connecting fail; the drain then backs off (as for a
single broker: exponentially, up to 10 s, ending the wait early when one of
them starts listening again) and makes the next pass. So with
``A;B`` and A down, the drain publishes through B at once.

* ``round-robin`` (Celery's default): the first pass starts with the first
  broker; every later one with the broker after the one that failed last.
  When the broker in use dies, the drain reconnects to the next one, and stays
  there until that one dies in turn (it does not go back to the first when
  the first comes back). A pass in which every broker failed ends where it
  began, so the next pass starts there again.
* ``shuffle``: every pass tries each broker once, in a new random order, the
  one that failed last (or was just lost) going last. (kombu picks a random
  broker at every try instead, possibly the same one several times running.)

Every URL stands alone: a URL without a user name, password or port gets the
defaults (``guest``, ``guest``, 5672), not those of the list's first URL
(kombu carries the first URL's port over to the others).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence

import pika

from drain.broker import reachable
from drain.broker.broker_options import (
    DEFAULT_HEARTBEAT,
    STRATEGIES,
    AppBroker,
    BrokerOptions,
    heartbeat_for,
)
from drain.errors import ConfigError
from drain.settings.config import DEFAULT_BROKER_URL, Settings
from drain.settings.urls import broker_list_parameters, secrets_of

log = logging.getLogger("drain.broker_list")


@dataclasses.dataclass(frozen=True, eq=False)
class Broker:
    """One broker of the list."""

    #: Its URL with the password masked: what logs and errors show.
    shown: str
    parameters: pika.ConnectionParameters
    #: Its place in the list, from 1.
    position: int


class BrokerList:
    """The brokers of one drain and the failover order (see the module's docstring).

    :meth:`attempts` gives one pass; :meth:`failed` and :meth:`connected` say
    how each attempt went, which decides the next pass.
    """

    def __init__(
        self,
        brokers: Sequence[Broker],
        *,
        strategy: str = STRATEGIES[0],
        secrets: Sequence[str] = (),
        origin: str = "",
        rng: random.Random | None = None,
    ) -> None:
        if not brokers:
            raise ConfigError("the broker list is empty")
        if strategy not in STRATEGIES:
            raise ConfigError(f"broker failover strategy must be "
                              f"{' or '.join(repr(s) for s in STRATEGIES)}, got {strategy!r}")
        self.brokers = tuple(brokers)
        self.strategy = strategy
        #: The passwords of the list (drain.settings.urls.secrets_of), for scrubbing driver text.
        self.secrets = list(secrets)
        #: Where the list comes from ("--broker-url", "the Celery app's broker_url"...).
        self.origin = origin
        self._rng = rng or random.Random()  # noqa: S311 - an order, not a secret
        self._current = 0
        self._next = 0
        #: The broker that failed (or was lost) last: shuffle tries it last.
        self._last_failed: int | None = None

    @classmethod
    def single(cls, parameters: pika.ConnectionParameters, shown: str) -> BrokerList:
        """A list of one broker."""
        return cls([Broker(shown, parameters, 1)])

    def __len__(self) -> int:
        return len(self.brokers)

    @property
    def current(self) -> Broker:
        """The broker connected to, or tried last (the first before any attempt)."""
        return self.brokers[self._current]

    def attempts(self) -> list[Broker]:
        """One pass: every broker once, in the order to try them now."""
        n = len(self.brokers)
        if self.strategy == "round-robin":
            order = [(self._next + k) % n for k in range(n)]
        else:
            order = list(range(n))
            self._rng.shuffle(order)
            if self._last_failed is not None and n > 1:
                order.remove(self._last_failed)
                order.append(self._last_failed)
        return [self.brokers[i] for i in order]

    def failed(self, broker: Broker) -> None:
        """An attempt at ``broker`` failed: the next attempt goes to the one after it."""
        self._moved_past(broker)

    def connected(self, broker: Broker) -> None:
        """The drain is connected to ``broker``; once that connection is lost, the
        next pass starts with the broker after it."""
        self._moved_past(broker)

    def _moved_past(self, broker: Broker) -> None:
        index = broker.position - 1
        self._current = index
        self._next = (index + 1) % len(self.brokers)
        self._last_failed = index

    def addresses(self) -> list[reachable.Address]:
        """Every broker's address, resolved now: where to knock while waiting to
        reconnect (drain.broker.reachable; one that listens again ends the wait)."""
        return [address for broker in self.brokers
                for address in reachable.tcp_addresses(broker.parameters.host,
                                                       broker.parameters.port)]

    def describe(self) -> str:
        """The list, masked, and how it is used: for the start-up log."""
        text = ";".join(broker.shown for broker in self.brokers)
        if len(self.brokers) > 1:
            text += f" (failover: {self.strategy})"
        return text


def build(urls: str | Sequence[str], options: BrokerOptions | None = None, *,
          origin: str = "--broker-url", heartbeat: int = DEFAULT_HEARTBEAT) -> BrokerList:
    """The brokers of a URL or list, reached as ``options`` say (the drain's
    defaults without them). Raises :class:`ConfigError` for a URL or an
    option that cannot be used, naming where it came from."""
    options = options or BrokerOptions()
    tls = options.tls()
    try:
        found = broker_list_parameters(
            urls, heartbeat=heartbeat_for(options.heartbeat, heartbeat), tls=tls,
            server_hostname=options.server_hostname)
    except ConfigError as exc:
        if origin.startswith("the Celery app"):
            raise ConfigError(f"{origin}: {exc}") from None
        raise
    brokers = []
    for position, (shown, parameters) in enumerate(found, 1):
        options.configure(parameters, shown)
        brokers.append(Broker(shown, parameters, position))
    text = urls if isinstance(urls, str) else ";".join(urls)
    return BrokerList(brokers, strategy=options.failover_strategy,
                      secrets=secrets_of(broker_url=text), origin=origin)


def of_settings(settings: Settings, app: AppBroker | None = None) -> BrokerList:
    """The brokers of ``settings``, with what the Celery app says (``app``,
    drain.celery.celery_app.broker_settings) when ``--app`` is given.

    ``settings.broker_url`` (``--broker-url`` / ``DRAIN_BROKER_URL``) wins over
    the app's URLs, as ``celery -b`` does; the app's other broker settings
    apply either way.
    """
    options = app.options if app is not None else BrokerOptions()
    if settings.broker_url is not None:
        urls: str | Sequence[str] = settings.broker_url
        origin = "--broker-url"
    elif app is not None and app.separate:
        raise ConfigError(
            f"the Celery app sets {', '.join(app.separate)} apart from its broker URL; "
            "drain reads the user name, password, port and vhost from the URL alone: "
            f"put them in {app.setting} (or give --broker-url)")
    elif app is not None and app.urls:
        urls, origin = app.urls, f"the Celery app's {app.setting}"
    else:
        urls, origin = DEFAULT_BROKER_URL, "the default"
    brokers = build(urls, options, origin=origin, heartbeat=settings.broker_heartbeat)
    extra = options.describe(settings.broker_heartbeat)
    if app is not None or len(brokers) > 1:
        log.info("brokers from %s: %s%s", origin, brokers.describe(),
                 f"; {extra}" if extra else "")
    return brokers
