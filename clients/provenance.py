"""Where a bench's output came from: the date and the commit, written into every table and
figure a bench regenerates (a figure in the docs says which code made it, and when)."""

from __future__ import annotations

import subprocess
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@cache
def provenance() -> dict[str, str]:
    """``date`` (UTC, ISO 8601) and ``commit`` (``git describe``: ``-dirty`` if the tree had
    changes; ``unknown`` outside a git checkout), fixed for the whole run."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                                cwd=ROOT, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit}


def stamp() -> str:
    """One line for a figure's footer or under a markdown table."""
    p = provenance()
    return f"generated {p['date']} at commit {p['commit']}"


def save_figure(fig, path: Path, dpi: int) -> None:
    """Save a matplotlib figure with the provenance in its footer and its PNG metadata."""
    fig.text(0.995, 0.003, stamp(), ha="right", va="bottom", fontsize=6, color="grey")
    fig.savefig(path, dpi=dpi, metadata={"Comment": stamp()})
