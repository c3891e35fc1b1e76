"""docker-compose.yml is valid against the compose specification (checked offline)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_follows_the_spec():
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_role_in_compose_writes_a_repository(tmp_path):
    from orchestrator.cluster.launcher import repo_main

    for role, models in [("frontend", 4), ("prefill", 1), ("decode", 1)]:
        out = tmp_path / role
        assert repo_main([role, str(out), "--model", "/model", "--secret", "ab"]) == 0
        assert len([p for p in out.iterdir() if (p / "config.pbtxt").is_file()]) == models
