"""Every internal link of the README and of docs/ resolves.

docs/ is checked by mkdocs itself: ``mkdocs build`` with ``strict: true`` and
every ``validation`` check at ``warn`` (mkdocs.yml) fails on a link to a missing
page or a missing anchor. The README lies outside mkdocs' docs_dir, so its links
are checked here the way mkdocs checks theirs: the target file exists and, for
``file.md#anchor``, the anchor is one Python-Markdown's toc extension (what
mkdocs renders headings with) gives a heading of that file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import markdown

from tests import support

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    md = markdown.Markdown(extensions=["toc"])
    html = md.convert(path.read_text())
    return set(re.findall(r'\bid="([^"]+)"', html))


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file)) if file else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no such heading in {resolved.name}")
    return broken


def test_every_readme_link_resolves() -> None:
    assert broken_links(support.ROOT / "README.md") == []


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Known heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](a.md#known-heading) [gone](b.md) [bad](a.md#nope) [web](https://x.org)")
    assert broken_links(page) == ["b.md: no such file", "a.md#nope: no such heading in a.md"]


def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """mkdocs.yml: strict, links and anchors validated; any warning fails the build."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--site-dir", str(tmp_path / "site")],
        cwd=support.ROOT, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "index.html").is_file()
