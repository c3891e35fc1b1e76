"""Fixtures shared by the serving tests."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model(tiny_model: Callable[[str], Path]) -> Path:
    """The tiny Llama the serving tests run (4 layers: depth 2 and 3 split them unevenly)."""
    return tiny_model("llama")


LOG_LINES_KEPT = 40  # per log file, of a failed test's cluster
TRITON_LINE = re.compile(r"[IWEF]\d{4} |[+|]")  # its log prefix, its tables


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's clusters' own log lines (not Triton's), beside its failure: CI keeps
    nothing else of a run, and a rare failure is otherwise read from its assertion alone."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from orchestrator.cluster.launcher import Cluster

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, Cluster):
            report.sections.append((f"cluster {name}: its log lines", cluster_log(value.run_dir)))


def cluster_log(run_dir: Path) -> str:
    """The last lines each process of the cluster logged itself (Triton's own lines, its
    tables and blank lines left out)."""
    parts = []
    for path in sorted((run_dir / "logs").glob("*.log")):
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if line.strip() and not TRITON_LINE.match(line)]
        if lines:
            parts.append(f"--- {path.name}\n" + "\n".join(lines[-LOG_LINES_KEPT:]))
    return "\n".join(parts)
