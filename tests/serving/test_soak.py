"""``dejavu bench soak`` at its shortest: a mixed load on a depth-2 pipeline with a P-node and
a spare while the frontend is killed (its clients send again once it is back); nothing lost,
duplicated or mismatched, and the report's files hold what the run measured. (Kills of the
other roles: test_faults, test_stage_faults, test_spares; all of them in turn: the README's
30-minute run.)"""

from __future__ import annotations

import csv

import pytest

from benchmarks import soak

pytestmark = pytest.mark.slow


def rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_short_soak_loses_nothing_and_reports_every_role(tiny_model, tmp_path):
    out = tmp_path / "out"
    code = soak.main(["--model", str(tiny_model("llama")), "--seconds", "30", "--clients", "3",
                      "--kill-every", "12", "--kills", "frontend", "--sample-s", "1",
                      "--out", str(out)])
    requests = {r["kind"]: r for r in rows(out / "soak_requests.csv")}
    total = requests["all"]
    assert code == 0
    assert int(total["requests"]) >= 10 and int(total["served"]) >= 5
    for bad in soak.BAD_OUTCOMES:
        assert total[bad] == "0", total
    assert int(total["requests"]) == sum(int(total[s]) for s in soak.STATUSES)
    assert int(total["left"]) > 0 and int(total["refused"]) > 0
    kills = rows(out / "soak_kills.csv")  # one: a second would need 12 + back + 12 + 10 s <= 30
    assert [k["role"] for k in kills] == ["frontend"]
    assert float(kills[0]["back_s"]) > 0 and kills[0]["new_pid"] != kills[0]["old_pid"]
    summary = {r["role"]: r for r in rows(out / "soak_roles.csv")}
    assert {"prefill0", "decode0s0", "decode0s1", "spare0", "frontend", "controller",
            "supervisor", "watchdog", "openai"} <= set(summary)
    assert int(summary["frontend"]["incarnations"]) == 2  # killed once, started again
    for role in summary.values():
        assert float(role["rss_mb_max"]) > 0 and int(role["threads_max"]) >= 1
        assert int(role["fds_max"]) >= 3
    assert float(summary["decode0s0"]["shm_mb_max"]) > 0  # its Python stubs' regions
    samples = rows(out / "soak_procs.csv")
    assert max(float(s["t_s"]) for s in samples) >= 25
    assert (out / "soak.png").stat().st_size > 10_000
    assert "lost 0, duplicated 0, mismatched 0" in (out / "soak.md").read_text()
