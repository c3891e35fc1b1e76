"""The README stays a five-minute page whose commands run as written, and no link in it or
in docs/ points at nothing."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from orchestrator import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_BYTES = 16 * 1024


def fenced_commands(text: str) -> list[list[str]]:
    """The shell lines of the fenced blocks that start with ``dejavu`` or ``make``,
    split as the shell would (trailing comments dropped)."""
    commands, language = [], None  # language: None outside a fence
    for line in text.splitlines():
        if line.startswith("```"):
            language = line[3:].strip() if language is None else None
        elif language in ("bash", "sh"):
            words = shlex.split(line, comments=True)
            if words and words[0] in ("dejavu", "make"):
                commands.append(words)
    return commands


class _Parsed(Exception):
    """Raised in place of running a command once its arguments have parsed."""


@pytest.fixture
def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``dejavu`` subcommand builds its parser and calls ``parse_args`` first: stop
    there, so checking a command starts no cluster."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)


def test_the_readme_is_a_short_page() -> None:
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes, over {MAX_README_BYTES}"


def test_the_readme_shows_commands_to_check() -> None:
    words = {c[0] for c in fenced_commands(README.read_text())}
    assert words == {"dejavu", "make"}


@pytest.mark.parametrize("command", [c for c in fenced_commands(README.read_text())
                                     if c[0] == "dejavu"], ids=" ".join)
def test_each_dejavu_command_of_the_readme_parses(command: list[str], parse_only: None) -> None:
    with pytest.raises(_Parsed):
        cli.main(command[1:])


@pytest.mark.parametrize("command", [c for c in fenced_commands(README.read_text())
                                     if c[0] == "make"], ids=" ".join)
def test_each_make_target_of_the_readme_exists(command: list[str]) -> None:
    done = subprocess.run(["make", "-n", *command[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _relative_links(page: Path) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return [link for link in links if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in _relative_links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
            if anchor not in slugs:
                broken.append(link)
    assert not broken, f"{page.name}: {broken}"
