"""The schema version staging_schema.sql records is drain.postgres.migration.SCHEMA_VERSION."""

from __future__ import annotations

import re

from drain.postgres import sql
from drain.postgres.migration import SCHEMA_VERSION


def test_the_schema_records_this_drains_version() -> None:
    recorded = re.findall(r"VALUES \('schema_version', '(\d+)'\)", sql.schema_text())
    assert recorded == [str(SCHEMA_VERSION)]
