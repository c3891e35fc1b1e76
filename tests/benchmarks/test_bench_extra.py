"""Without the ``bench`` extra (rich, matplotlib), ``dejavu bench`` says what to install."""

from __future__ import annotations

import importlib

from orchestrator import cli


def test_a_missing_report_library_names_the_extra(monkeypatch, capsys):
    def without_rich(name: str):
        raise ModuleNotFoundError("No module named 'rich'", name="rich")

    monkeypatch.setattr(importlib, "import_module", without_rich)
    assert cli.main(["bench", "kv", "--quick"]) == 2
    assert "install the bench extra (pip install -e '.[bench]')" in capsys.readouterr().err
