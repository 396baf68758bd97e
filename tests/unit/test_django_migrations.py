"""drain's Django migrations (drain.postgres.django) keep in step with SCHEMA_VERSION,
and ``import drain`` imports neither Django nor Alembic (both optional).

One migration per schema version, ``000N_schema_version_N``, each a non-atomic
``RunPython`` of drain.postgres.django.schema.forwards depending on the one before
(drain.postgres.django.schema says why). A release that raises SCHEMA_VERSION
without adding its migration fails here.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import resources

from drain.postgres.migration import SCHEMA_VERSION

PACKAGE = "drain.postgres.django.migrations"


def _names() -> list[str]:
    files = resources.files(PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".py") for f in files
                  if f.name.endswith(".py") and f.name != "__init__.py")


def test_one_migration_per_schema_version() -> None:
    assert _names() == [f"{n:04d}_schema_version_{n}" for n in range(1, SCHEMA_VERSION + 1)]


def test_each_applies_the_schema_outside_a_transaction_after_the_one_before() -> None:
    from django.db import migrations

    from drain.postgres.django import schema

    previous: list[tuple[str, str]] = []
    for name in _names():
        migration = importlib.import_module(f"{PACKAGE}.{name}").Migration
        assert migration.atomic is False, name
        assert migration.dependencies == previous, name
        (operation,) = migration.operations
        assert isinstance(operation, migrations.RunPython), name
        assert operation.code is schema.forwards, name
        assert operation.reverse_code is schema.backwards, name
        previous = [("drain", name)]


def test_importing_drain_imports_neither_django_nor_alembic() -> None:
    code = ("import sys, drain, drain.store, drain.postgres.migration_tools\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('django', 'alembic')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
