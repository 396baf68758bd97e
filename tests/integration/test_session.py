"""The drain's own Postgres session: its settings, and the user's URL options kept."""

from __future__ import annotations

import psycopg

from drain.config import Settings
from drain.store import Store


def test_session_settings_and_user_options(db_url: str) -> None:
    url = db_url + "?options=-c%20search_path%3Dpublic,pg_catalog&keepalives_idle=9"
    store = Store(Settings(database_url=url, confirm_timeout=10))
    store.connect()
    try:
        assert store.try_lock()
        with psycopg.connect(db_url) as conn:
            row = conn.execute(
                "SELECT application_name FROM pg_stat_activity "
                "WHERE application_name LIKE 'drain pid=%%'"
            ).fetchone()
        assert row is not None and " since=" in row[0]
        conn2 = store._require()
        settings: dict[str, str] = {str(k): str(v) for k, v in conn2.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ("
            "'synchronous_commit', 'statement_timeout', 'idle_in_transaction_session_timeout',"
            "'search_path', 'tcp_keepalives_idle')"
        ).fetchall()}
        assert settings["synchronous_commit"] == "off"
        assert settings["statement_timeout"] == "30000"
        assert settings["idle_in_transaction_session_timeout"] == "40000"  # confirm + 30 s
        assert settings["search_path"] == "public,pg_catalog"  # the user's options survive
        assert conn2.info.get_parameters()["keepalives_idle"] == "9"
    finally:
        store.close()
