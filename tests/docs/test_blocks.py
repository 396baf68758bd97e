"""Every code block of README.md and docs/*.md runs, or says why not (tests/docs/blocks.py)."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from tests import support
from tests.docs import blocks

#: The pages of docs/; the README has a test of its own, below.
DOCUMENTS = sorted(p.name for p in (support.ROOT / "docs").glob("*.md"))


@pytest.fixture
def reader(db_url: str, queue: str, tmp_path: Path, django_db: str) -> blocks.Reader:
    return blocks.Reader(db_url, queue, tmp_path)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_the_code_blocks_of(name: str, reader: blocks.Reader) -> None:
    blocks.run_document(support.ROOT / "docs" / name, reader)


def test_the_code_blocks_of_the_readme(reader: blocks.Reader) -> None:
    """The README's blocks run, and do what they say: `drain migrate`, staging by psycopg and
    SQLAlchemy in this database, then `drain run --app yourproject.celery:app`
    publishes those jobs to the app's queue and leaves nothing staged."""
    skipped = blocks.run_document(support.ROOT / "README.md", reader)
    assert len(skipped) == 2, skipped  # pip install, make demo/test
    assert support.staged_count(reader.db_url) == 0
    with psycopg.connect(reader.db_url) as conn:
        assert conn.execute("SELECT text FROM annotation WHERE id = 42").fetchone() == ("edited",)
    messages = support.drain_queue(reader.queue)
    assert len(messages) == 2, messages  # psycopg and SQLAlchemy; Django's went to its own db


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


@pytest.mark.parametrize(("text", "error"), [
    ("```\nsome output\n```\n", "a (no language) block that does not run"),
    ("```yaml\na: 1\n```\n", "a yaml block that does not run"),
    ("```sql\nSELECT 1;\n```\n", "a sql block without the role that runs it"),
    ("<!-- sql-as: app_drain_stager -->\n```sql\nDELETE FROM staged_jobs;\n```\n",
     "InsufficientPrivilege"),
    ("<!-- sql-as: app_drain_stager -->\n", "sql-as: app_drain_stager is followed by no sql block"),
    ("<!-- sql-as: my_app -->\n```sql\nSELECT 1;\n```\n", "sql-as: 'my_app' is none of"),
    ("```sh\ndrain dead list --no-such-flag\n```\n", "exit 2"),
    ("```python\nassert user_id == 7\n```\n", "AssertionError"),
])
def test_a_block_that_fails_or_is_unmarked_fails_the_test(
    text: str, error: str, reader: blocks.Reader, tmp_path: Path
) -> None:
    page = _page(tmp_path, "# A page\n\n" + text)
    with pytest.raises(blocks.BlockFailed, match=re.escape(error)):
        blocks.run_document(page, reader)


def test_a_marked_block_is_skipped_with_its_reason(
    reader: blocks.Reader, tmp_path: Path
) -> None:
    page = _page(tmp_path, '<!-- skip: next "needs Docker" -->\n```sh\ndocker ps\n```\n'
                           '<!-- sql-as: app_drain_stager -->\n```sql\n'
                           "INSERT INTO staged_jobs (task_name) VALUES ('t');\n```\n")
    skipped = blocks.run_document(page, reader)
    assert skipped == [f"{page}, line 2: needs Docker"]
    assert support.staged_count(reader.db_url) == 1
