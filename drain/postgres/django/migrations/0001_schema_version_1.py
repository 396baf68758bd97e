"""drain schema version 1: the staging schema, its settings and group roles.

``atomic = False``: drain's migrate runs its own transactions, with lock-timeout
retries (drain.postgres.django.schema).
"""

from __future__ import annotations

from typing import ClassVar

from django.db import migrations

from drain.postgres.django import schema


class Migration(migrations.Migration):  # type: ignore[misc]  # Django has no type hints here
    initial = True
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[object]] = [migrations.RunPython(schema.forwards, schema.backwards)]
