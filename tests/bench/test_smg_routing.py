"""``bench.smg_routing`` without an ``smg`` executable skips, saying how to get one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.smg_routing import main


def test_without_smg_it_skips_saying_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--smg", str(tmp_path / "smg")]) == 0
    assert capsys.readouterr().out.startswith("skipped: no smg executable")
