"""``drain.store.migrate(conn)``: the schema migration ``drain migrate`` runs, for
an application's own migrations and tests (docs/testing.md). It lives in
:mod:`drain.postgres.store`; this name is kept for code that imports it here.
"""

from drain.postgres.migration import migrate

__all__ = ["migrate"]
