"""The README and docs/ as documentation: a README a newcomer reads in one sitting, and
links that work in any clone (inside the repository, never to this machine's paths)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15_000
LINK = re.compile(r"\]\(([^)\s]+)\)")
MACHINE_PATHS = ("/work/", "/tmp/", "/root/", "file://", "../shared")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted(REPO.glob("packages/*/README.md")), REPO / "examples" / "README.md"]


def _broken(text: str, folder: Path) -> list[str]:
    """The links in ``text`` (a page in ``folder``) that point at this machine or at
    nothing in the repository."""
    bad = []
    for target in LINK.findall(text):
        if any(p in target for p in MACHINE_PATHS):
            bad.append(f"{target} (a machine-local path)")
            continue
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor in the page itself
        path = (folder / target.split("#")[0]).resolve()
        if not path.is_relative_to(REPO):
            bad.append(f"{target} (outside the repository)")
        elif not path.exists():
            bad.append(f"{target} (no such file)")
    return bad


def test_the_readme_stays_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): " \
        "measurements go to docs/, how things work to docs/<tier>.md"


def test_every_doc_link_resolves_inside_the_repository():
    pages = [p for p in _pages() if p.exists()]
    assert REPO / "README.md" in pages and len(pages) > 10
    broken = {str(p.relative_to(REPO)): b for p in pages
              if (b := _broken(p.read_text(), p.parent))}
    assert not broken, f"links that do not work in a clone: {broken}"


def test_the_link_check_sees_what_it_forbids():
    text = ("[a](../shared/DESIGN.md) [b](/work/x.md) [c](nowhere.md) [d](../../up.md) "
            "[e](https://x.org) [f](#top) [g](design.md#scheduling-modes)")
    assert _broken(text, REPO / "docs") == [
        "../shared/DESIGN.md (a machine-local path)", "/work/x.md (a machine-local path)",
        "nowhere.md (no such file)", "../../up.md (outside the repository)"]
