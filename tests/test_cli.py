"""The `tileops` command line: export is fresh, check passes."""
from __future__ import annotations

from pathlib import Path

import pytest

from tilelang_ops import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_export_check_passes_on_committed_sources():
    assert cli.main(["export", "--check", "--quiet", "--dir", str(ROOT / "csrc_generated")]) == 0


@pytest.mark.slow
def test_export_check_detects_stale(tmp_path):
    assert cli.main(["export", "--quiet", "--dir", str(tmp_path)]) == 0
    files = sorted(tmp_path.rglob("*.cu"))
    assert files
    files[0].write_text(files[0].read_text() + "// edited\n")
    (tmp_path / "elementwise" / "orphan.cu").write_text("//")
    assert cli.main(["export", "--check", "--quiet", "--dir", str(tmp_path)]) == 1


@pytest.mark.slow
def test_check_passes(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "add" in out and ("NOT run" in out or "matched the reference" in out)
