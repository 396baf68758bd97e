"""Which database a test's connection is on, for a drain to connect to it too.

``drain_jobs.publish()`` runs a real drain, which opens its own sessions: it
needs the test database's URL. A test gives it (``drain_database_url``), or it
is read off the connection the test stages on:

* psycopg 3 (a connection or cursor): its connection parameters, password included;
* Django's ``connection``: its ``settings_dict`` (``NAME`` is the test
  database's name while Django's test runner or pytest-django has it set up);
* SQLAlchemy (a ``Connection``, ``Session`` or ``Engine``): its engine's URL,
  as libpq spells it (``postgresql://``, without the ``+driver``).
"""

from __future__ import annotations

from typing import Any

import psycopg

from drain import consumer_sql
from drain.errors import FixtureError

#: Django settings_dict keys -> libpq keywords.
_DJANGO_KEYS = {"NAME": "dbname", "USER": "user", "PASSWORD": "password", "HOST": "host",
                "PORT": "port"}


def database_url(conn: Any) -> str:
    """A libpq connection string for the database ``conn`` is connected to."""
    if consumer_sql.is_django(conn):
        params = {_DJANGO_KEYS[key]: str(value)
                  for key, value in getattr(conn, "settings_dict", {}).items()
                  if key in _DJANGO_KEYS and value}
        return psycopg.conninfo.make_conninfo(**params)
    if consumer_sql.is_sqlalchemy(conn):
        engine = getattr(conn, "engine", None) or conn.get_bind()
        url = engine.url.set(drivername="postgresql")
        return str(url.render_as_string(hide_password=False))
    driver = getattr(conn, "connection", conn)  # a psycopg cursor's connection
    if isinstance(driver, psycopg.Connection):
        password = driver.info.password
        return psycopg.conninfo.make_conninfo(driver.info.dsn,
                                              **({"password": password} if password else {}))
    raise FixtureError(
        f"cannot tell which database a {type(conn).__module__}.{type(conn).__name__} is on: "
        "give its URL by overriding the drain_database_url fixture (or the "
        "drain_database_url ini option)")
