"""The documentation stays true: generated flags current, no links out of the repository,
a README that stays a README, relative links that resolve."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve.tools import gen_flags

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
# Spelled in two pieces so that this file does not match itself.
OUTSIDE_REFERENCE = b"../" + b"shared"


def _repo_files() -> list[Path]:
    """Tracked files plus untracked ones git does not ignore (what a commit would add)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return [ROOT / name for name in sorted(set(out.decode().split("\0"))) if name]


def test_flags_doc_is_current() -> None:
    assert gen_flags.check(gen_flags.DEFAULT_OUTPUT), (
        f"docs/flags.md is stale: run `{gen_flags.REGENERATE}`"
    )


def test_flags_doc_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "a-secret-key")
    monkeypatch.setenv("PAGEDSERVE_INTERNAL_TOKEN", "a-secret-token")
    text = gen_flags.render()
    assert "a-secret" not in text
    assert "env `PAGEDSERVE_API_KEY`" in text


def test_nothing_refers_outside_the_repository() -> None:
    offenders = []
    for path in _repo_files():
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(".ci/") or not path.is_file():
            continue
        if OUTSIDE_REFERENCE in path.read_bytes():
            offenders.append(relative)
    assert not offenders, f"files referring to {OUTSIDE_REFERENCE.decode()}: {offenders}"


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def _anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    anchors = set()
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if heading := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            anchors.add(slug.replace(" ", "-"))
    return anchors


def test_relative_links_resolve() -> None:
    link = re.compile(r"\]\(([^)\s]+)\)")
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in link.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = doc.parent / path if path else doc
            if not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{doc.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, f"broken relative links: {broken}"
