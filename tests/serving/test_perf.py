"""``dejavu bench serving``: perf_analyzer, genai-perf and aiperf against a real cluster, briefly.

The tools are installed by ``scripts/perf_tools.sh`` when missing (CI starts
from a fresh machine); a failed install fails the test, it is never skipped.
"""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from cluster_helpers import reference

from clients.perf import (
    GENAI_APIS,
    PROMPT,
    BenchError,
    Tools,
    install_tools,
    main,
    run_perf_analyzer,
    summarize_export,
)

MAX_TOKENS = 8
REQUESTS = 3  # per concurrent stream
CONCURRENCY = [1, 2]


def _export(requests: list[tuple[int, list[int]]], concurrency: int = 1) -> dict:
    """A perf_analyzer profile export: (sent ns, [response ns, ...]) per request."""
    return {"experiments": [{
        "experiment": {"mode": "concurrency", "value": concurrency},
        "requests": [{"timestamp": t, "response_timestamps": r} for t, r in requests],
    }]}


def test_summarize_export_times_each_request():
    ms = 1_000_000
    export = _export([(0, [10 * ms, 12 * ms, 14 * ms]), (14 * ms, [20 * ms, 26 * ms, 32 * ms])])
    point = summarize_export(export, "colocated", 1, max_tokens=3)
    assert (point.requests, point.tokens) == (2, 6)
    assert point.tokens_per_s == pytest.approx(6 / 0.032)
    assert point.requests_per_s == pytest.approx(2 / 0.032)
    assert point.ttft_p50_ms == pytest.approx(8.0)  # median of 10 and 6
    assert point.ttft_p99_ms == pytest.approx(10.0)
    assert point.itl_ms == pytest.approx((2.0 + 6.0) / 2)


def test_summarize_export_rejects_cut_streams_and_missing_levels():
    export = _export([(0, [1, 2, 3]), (3, [4, 5])])
    with pytest.raises(BenchError, match="1 of 2 requests streamed 2 tokens, not max_tokens=3"):
        summarize_export(export, "colocated", 1, max_tokens=3)
    with pytest.raises(BenchError, match="no requests at concurrency 4"):
        summarize_export(export, "colocated", 4, max_tokens=3)


def test_a_cut_short_export_is_measured_again(tmp_path):
    """perf_analyzer 2.51 can cut its export short (a NaN stops its JSON writer) and refuses
    to write over an export: the bench removes the cut one and runs it again."""
    good = json.dumps(_export([(0, [1_000_000, 2_000_000])]))
    tool = tmp_path / "perf_analyzer"  # a stand-in: cut the first export, then a whole one
    tool.write_text(f"""#!/bin/sh
[ -e export.json ] && {{ echo "Path must not already exist"; exit 99; }}
if [ -e ran ]; then echo '{good}' > export.json; else touch ran; echo '{{"exp' > export.json; fi
""")
    tool.chmod(0o755)
    point = run_perf_analyzer(Tools(tool, "", tool, tool), "127.0.0.1:1", "colocated", 1, 1, 2,
                              "hi", tmp_path)
    assert (point.requests, point.tokens) == (1, 2)


@pytest.mark.slow
def test_bench_serving_against_a_real_cluster(tiny_model, tmp_path):
    install_tools()  # raises (the test fails) when the tools cannot be installed
    model = tiny_model("llama")
    out = tmp_path / "bench"
    argv = ["--model", str(model), "--modes", "disaggregated", "--max-tokens", str(MAX_TOKENS),
            "--requests", str(REQUESTS), "--genai-concurrency", "2", "--out", str(out),
            "--genai-apis", *GENAI_APIS, "--aiperf",
            "--rounds", "2", "--concurrency", *map(str, CONCURRENCY)]
    assert main(argv) == 0

    with (out / "perf_analyzer.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["concurrency"]) for r in rows] == CONCURRENCY
    for row in rows:
        requests, tokens = int(row["requests"]), int(row["tokens"])
        assert requests == REQUESTS * int(row["concurrency"])  # every request completed
        assert tokens == requests * MAX_TOKENS
        low, high = map(float, row.pop("served_over_bare_range").split("-"))
        assert row.pop("commit") and row.pop("date").startswith("20")  # its provenance
        numbers = {k: float(v) for k, v in row.items() if k not in ("mode", "concurrency")}
        # the reported round is the median one of the two (the lower), in their range
        assert numbers["rounds"] == 2 and low == pytest.approx(
            numbers["served_over_bare"], abs=0.006) and high >= low
        assert all(v > 0 and math.isfinite(v) for k, v in numbers.items()
                   if k != "overhead_ms_per_token"), numbers
        assert numbers["tokens_per_s"] == pytest.approx(numbers["requests_per_s"] * MAX_TOKENS)
        assert numbers["ttft_p50_ms"] <= numbers["ttft_p99_ms"]
        # time per token served = bare time per token + overhead, both ways of reporting agree
        assert 1e3 / numbers["tokens_per_s"] == pytest.approx(
            1e3 / numbers["bare_tokens_per_s"] + numbers["overhead_ms_per_token"])

    # What perf_analyzer streamed are the reference's greedy tokens, in order (end_id -1:
    # all MAX_TOKENS of them, as the bench sends).
    expected = reference(model, [PROMPT], MAX_TOKENS, to_end=False)[0]
    exports = sorted((out / "disaggregated").glob("c*/round*/export.json"))
    assert len(exports) == 2 * len(CONCURRENCY)  # every round of every point
    for export_file in exports:
        export = json.loads(export_file.read_text())
        for request in export["experiments"][0]["requests"]:
            # a token per response, or several for a stream that fell behind; none empty
            streamed = [np.ravel(r["output_ids"]).tolist() for r in request["response_outputs"]]
            assert all(streamed) and [t for ids in streamed for t in ids] == expected

    # genai-perf over every API, and aiperf over completions: unchanged tools, every request
    # answered (each tool exits non-zero on a failed request).
    with (out / "genai_perf.csv").open() as f:
        runs = {(r["tool"], r["api"]): r for r in csv.DictReader(f)}
    assert set(runs) == {("genai-perf", api) for api in GENAI_APIS} | {("aiperf", "completions")}
    for (tool, api), run in runs.items():
        assert int(run["requests"]) == REQUESTS * 2, (tool, api)
        streamed = int(run["streamed"])
        if api in ("generate", "kserve") or tool == "aiperf":
            # every token of every request (output_ids; aiperf: the server's usage count)
            assert streamed == REQUESTS * 2 * MAX_TOKENS, (tool, api, streamed)
        else:  # chunks with text: one may carry several tokens, or none (a partial character)
            assert REQUESTS * 2 <= streamed <= REQUESTS * 2 * MAX_TOKENS, (tool, api, streamed)
        for key in ("requests_per_s", "tokens_per_s", "ttft_avg_ms", "output_len_avg"):
            assert float(run[key]) > 0, (tool, api, key)
        assert float(run["ttft_avg_ms"]) <= float(run["ttft_p99_ms"]), (tool, api)
