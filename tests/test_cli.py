"""The `tileops` command line: export is fresh, check passes."""
from __future__ import annotations

import pytest

from tests.helpers import ROOT
from tilelang_ops import cli


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


def test_export_compare_ignores_only_tilelang_workspace_naming():
    # TileLang swaps the names of a kernel's reduction workspaces between processes; any other
    # difference is a stale source.
    a = "float* workspace = s + 0;\nfloat* workspace_1 = s + 0;\nrun(workspace_1);\nrun(workspace);\n"
    b = "float* workspace = s + 0;\nfloat* workspace_1 = s + 0;\nrun(workspace);\nrun(workspace_1);\n"
    assert cli._same_source(a, b)
    assert not cli._same_source(a, a.replace("s + 0", "s + 16"))
    assert not cli._same_source(a, a + "// edited\n")
