"""``make release`` and CHANGELOG.md: the version from git tags, the wheel and sdist checked.

``make release`` runs in a ``git clone`` of this repository in a temporary directory, so
that it neither dirties nor depends on the caller's tree: the clone has this checkout's
commits, with the release machinery of its working tree (the Makefile, pyproject.toml and
CHANGELOG.md) committed on top when it differs, so that an edit to them is what is tested.
Its tags are the test's own. ``-o venv``: the release runs with this interpreter's
venv (``BIN``) instead of making the clone's (a whole dev install).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from drain.postgres import migration
from tests import previous, support

#: What make release reads from the working tree besides the commits.
MACHINERY = ("Makefile", "pyproject.toml", "CHANGELOG.md")
#: A release heading of CHANGELOG.md: "## 0.2.0 (2026-12-01)" or "## 0.2.0 (unreleased)".
HEADING = re.compile(r"^## (\d+\.\d+\.\d+) \(([^)]*)\)$", re.MULTILINE)
GIT_ID = ("-c", "user.name=drain tests", "-c", "user.email=tests@drain.invalid")


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *GIT_ID, *args], cwd=repo, capture_output=True, text=True,
                          check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"git {args} exited {done.returncode}: {done.stderr}"
    return done.stdout


def clone(tmp_path: Path, *, tags: bool = False) -> Path:
    """This repository's commits in ``tmp_path/repo``, its tags only if ``tags``, and the
    working tree's release machinery committed on top."""
    repo = tmp_path / "repo"
    flags = [] if tags else ["--no-tags"]
    git(tmp_path, "clone", "--quiet", *flags, str(support.ROOT), str(repo))
    for name in MACHINERY:
        shutil.copyfile(support.ROOT / name, repo / name)
    git(repo, "add", *MACHINERY)
    if git(repo, "status", "--porcelain"):
        git(repo, "commit", "--quiet", "-m", "the release machinery of the working tree")
    return repo


def make_release(repo: Path) -> subprocess.CompletedProcess[str]:
    """``make release`` in ``repo``, as a make of its own: not a sub-make of the ``make
    test`` that may run this test (MAKELEVEL, MAKEFLAGS: its jobserver, its name)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(
        ["make", "--no-print-directory", "-o", "venv", "release",
         f"BIN={Path(sys.executable).parent}"],
        cwd=repo, capture_output=True, text=True, timeout=600, check=False,
        stdin=subprocess.DEVNULL, env=env)


def own_lines(stderr: str) -> list[str]:
    """stderr without make's own "make: *** [...] Error 1" trailer (make[N] in a
    sub-make)."""
    return [line for line in stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]


def newest_entry(text: str) -> tuple[str, str, str]:
    """(version, its parenthesis, its text up to the next release heading)."""
    found = HEADING.search(text)
    assert found, "CHANGELOG.md has no release heading '## X.Y.Z (<date>|unreleased)'"
    following = HEADING.search(text, found.end())
    return found[1], found[2], text[found.end():following.start() if following else None]


def release(repo: Path, version: str) -> None:
    """Date CHANGELOG.md's entry for ``version``, commit, tag the commit v<version>."""
    changelog = repo / "CHANGELOG.md"
    text = changelog.read_text()
    changelog.write_text(re.sub(rf"^## {re.escape(version)} \(unreleased\)$",
                                f"## {version} (2026-12-01)", text, flags=re.MULTILINE))
    git(repo, "commit", "--quiet", "--allow-empty", "-am", f"drain-outbox {version}")
    git(repo, "tag", "-a", f"v{version}", "-m", f"drain-outbox {version}")


def test_a_tagged_commit_is_released_as_the_tags_version(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    version, _, _ = newest_entry((repo / "CHANGELOG.md").read_text())
    release(repo, version)
    done = make_release(repo)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"make release: built drain-outbox {version}\n" in done.stdout
    assert "warning" not in (done.stdout + done.stderr).lower()
    built = sorted(p.name for p in (repo / "dist").iterdir())
    assert built == [f"drain_outbox-{version}-py3-none-any.whl", f"drain_outbox-{version}.tar.gz"]
    for name in built:
        assert f"Checking dist/{name}: " in done.stdout
    assert done.stdout.count("PASSED") == 2
    # The sdist carries its version (PKG-INFO) and the CHANGELOG, for a build without .git.
    with tarfile.open(repo / "dist" / f"drain_outbox-{version}.tar.gz") as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        pkg_info = sdist.extractfile(f"drain_outbox-{version}/PKG-INFO")
        assert pkg_info is not None
        assert f"\nVersion: {version}\n" in pkg_info.read().decode()
    assert "CHANGELOG.md" in names
    assert not git(repo, "status", "--porcelain")  # dist/ is ignored


def test_without_tags_the_build_is_a_dev_version_with_a_warning(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    assert not git(repo, "tag", "--list")
    done = make_release(repo)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"^make release: built drain-outbox (\S+)$", done.stdout, re.MULTILINE)
    assert found, done.stdout
    version = found[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+\.dev\d+\+\S+", version), version
    assert (f"make release: warning: {version} is a dev version (no tag vX.Y.Z on this "
            "commit): not for the package index") in done.stderr
    assert (repo / "dist" / f"drain_outbox-{version}-py3-none-any.whl").exists()
    assert done.stdout.count("PASSED") == 2


def test_after_a_release_tag_the_next_commit_is_the_next_minor_dev_version(
    tmp_path: Path,
) -> None:
    repo = clone(tmp_path)
    git(repo, "tag", "-a", "v3.4.5", "HEAD~1", "-m", "an older release")
    git(repo, "tag", "v2-rehearsal", "-m", "not a version")  # ignored, not fatal
    done = subprocess.run([sys.executable, "-m", "hatchling", "version"], cwd=repo,
                          capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"3\.5\.0\.dev1\+g[0-9a-f]+", done.stdout.strip()), done.stdout


@pytest.mark.parametrize("change", ["a tracked file", "an untracked file"])
def test_a_tree_with_uncommitted_changes_is_refused_in_one_line(
    tmp_path: Path, change: str
) -> None:
    repo = clone(tmp_path)
    if change == "a tracked file":
        with (repo / "README.md").open("a") as readme:
            readme.write("\nnot committed\n")
    else:
        (repo / "drain" / "scratch.py").write_text("# would go into the sdist\n")
    done = make_release(repo)
    assert done.returncode != 0
    assert own_lines(done.stderr) == [
        "make release: the working tree has uncommitted changes (git status): commit them first"]
    assert not (repo / "dist").exists()


def test_a_release_tag_without_its_changelog_entry_is_refused(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    git(repo, "tag", "-a", "v9.8.7", "-m", "no entry for it")
    done = make_release(repo)
    assert done.returncode != 0
    assert own_lines(done.stderr)[-1] == (
        "make release: CHANGELOG.md has no entry for 9.8.7 (## 9.8.7 (<date>))")
    assert not (repo / "dist").exists()


def test_a_release_tag_on_an_entry_still_unreleased_is_refused(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    changelog = repo / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace(
        "\n## ", "\n## 9.8.7 (unreleased)\n\n### Upgrading\n\nNothing.\n\n## ", 1))
    git(repo, "commit", "--quiet", "-am", "an entry not yet dated")
    git(repo, "tag", "-a", "v9.8.7", "-m", "too early")
    done = make_release(repo)
    assert done.returncode != 0
    assert own_lines(done.stderr)[-1] == (
        "make release: CHANGELOG.md still says 9.8.7 is unreleased: date it, commit, and tag "
        "that commit v9.8.7")
    assert not (repo / "dist").exists()


# CHANGELOG.md itself.

def _changelog() -> str:
    return (support.ROOT / "CHANGELOG.md").read_text()


def test_every_release_has_an_upgrading_section() -> None:
    text = _changelog()
    headings = HEADING.findall(text)
    assert headings, "no release headings"
    versions = [_release_key(v) for v, _ in headings]
    assert versions == sorted(versions, reverse=True), "newest first"
    assert len(set(versions)) == len(versions)
    for when in [w for _, w in headings][1:]:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", when), f"an older release without a date: {when}"
    for version, _ in headings:
        _, _, entry = newest_entry(text[text.index(f"## {version} "):])
        assert "\n### Upgrading\n" in entry, f"{version} has no '### Upgrading'"


def test_the_newest_entry_names_the_schema_version_and_what_it_changes() -> None:
    """The schema version of this checkout (SCHEMA_VERSION) is named in the newest entry's
    Upgrading section, with each table the schema creates and each column it adds that the
    previous release's schema (its staging_schema.sql, from its tag or its commit,
    _previous_release) did not have."""
    version, _, entry = newest_entry(_changelog())
    upgrading = entry.split("\n### Upgrading\n", 1)[1].split("\n### ", 1)[0]
    assert f"Schema version {migration.SCHEMA_VERSION}" in upgrading
    assert "drain migrate --check" in upgrading
    release = _previous_release(version)
    before = _schema_objects(subprocess.run(
        ["git", "show", f"{release}:staging_schema.sql"], cwd=support.ROOT,
        capture_output=True, text=True, check=True).stdout)
    now = _schema_objects((support.ROOT / "staging_schema.sql").read_text())
    unnamed = sorted(name for name in now - before if f"`{name}`" not in upgrading)
    assert not unnamed, f"the Upgrading section of {version} does not name {unnamed}"


def test_the_schema_objects_parser_sees_tables_and_added_columns() -> None:
    sql = ("CREATE TABLE IF NOT EXISTS t (a int);\n"
           "ALTER TABLE t\n    ADD COLUMN IF NOT EXISTS b int,\n"
           "    ADD COLUMN IF NOT EXISTS c int;\n"
           "ALTER TABLE u ADD COLUMN IF NOT EXISTS d jsonb;\n")
    assert _schema_objects(sql) == {"t", "t.b", "t.c", "u.d"}


def _previous_release(version: str) -> str:
    """The newest tag vX.Y.Z of a release before ``version``; in a clone without tags
    (CI's), the previous release's commit the version-skew tests build
    (tests/previous.py), which must then be a release before ``version``."""
    tags = subprocess.run(["git", "tag", "--list", "v*.*.*"], cwd=support.ROOT,
                          capture_output=True, text=True, check=True).stdout.split()
    older = [t for t in tags if re.fullmatch(r"v\d+\.\d+\.\d+", t)
             and _release_key(t[1:]) < _release_key(version)]
    if older:
        return max(older, key=lambda tag: _release_key(tag[1:]))
    assert _release_key(previous.VERSION) < _release_key(version), (
        f"tests/previous.py's release {previous.VERSION} is not older than {version}")
    return previous.COMMIT


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _schema_objects(sql: str) -> set[str]:
    """The tables staging_schema.sql creates and the columns it adds (``table.column``)."""
    objects = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", sql))
    for table, columns in re.findall(r"ALTER TABLE (\w+)\s+(ADD COLUMN IF NOT EXISTS [^;]*);",
                                     sql):
        objects |= {f"{table}.{c}" for c in re.findall(r"ADD COLUMN IF NOT EXISTS (\w+)",
                                                         columns)}
    return objects
