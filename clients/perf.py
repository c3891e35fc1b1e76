"""``dejavu bench serving``: perf_analyzer, genai-perf and aiperf on a cluster, vs the bare engine.

For each mode (disaggregated 1P+1T, colocated 1T) a local cluster comes up
(or ``--url``/``--http-url``/``--openai-url`` name a running one) and perf_analyzer 2.51 streams
requests over gRPC (``--streaming``, a fixed prompt and ``max_tokens``) at each
concurrency; its per-request profile export gives tokens/s, time to first
token (TTFT) and inter-token latency (ITL). The bare engine loop
(``orchestrator.engine.reference.generate`` in this process, same weights,
batch = concurrency) runs right before and after each point: the ratio of time per token,
served over bare, is the serving overhead. genai-perf then runs once per mode and
API at one concurrency for its own TTFT/ITL, unchanged, over each API a user has:
Triton's HTTP ``generate_stream``, gRPC ``kserve`` (the ensemble's TensorRT-LLM
contract), and the OpenAI-compatible ``completions`` and ``chat``; aiperf (``--aiperf``)
over ``completions``. The tools come from ``scripts/perf_tools.sh`` (run here; a no-op
when installed). With ``--pin`` the T-node runs on the last core alone (its "machine") and
everything else (frontend, P-node, perf_analyzer) on the others, and the bare engine on
the T-node's core: the engine has the same core served and bare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from clients.common import (
    Machines,
    dummy_model,
    markdown,
    model_arguments,
    on_machine,
    print_table,
    write_csv,
)
from orchestrator.cluster.devices import Devices
from orchestrator.cluster.tritonserver import ServerError

ROOT = Path(__file__).resolve().parents[1]
TOOLS_SCRIPT = ROOT / "scripts" / "perf_tools.sh"
MODEL = "ensemble"
PROMPT = "The prompt phase reads the whole prompt, then the token phase writes one token at a time"
PA_TIMEOUT_S = 300.0
PA_ATTEMPTS = 3  # perf_analyzer runs per point until one writes a readable export
GENAI_TIMEOUT_S = 300.0
GENAI_APIS = ("generate", "kserve", "completions", "chat")
OPENAI_APIS = ("completions", "chat")  # served by the cluster's OpenAI-compatible API


class BenchError(RuntimeError):
    """A load tool failed or its output does not add up; the message says which and why."""


@dataclass(frozen=True)
class Tools:
    perf_analyzer: Path
    ld_library_path: str  # libcudart.so.12 for perf_analyzer
    genai_perf: Path
    aiperf: Path

    def env(self) -> dict[str, str]:
        """perf_analyzer 2.51 first on PATH: genai-perf runs whichever it finds."""
        env = dict(os.environ)
        env["PATH"] = f"{self.perf_analyzer.parent}:{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [self.ld_library_path,
                                                         env.get("LD_LIBRARY_PATH")]))
        return env


def install_tools() -> Tools:
    """Run ``scripts/perf_tools.sh`` (idempotent) and read where it put the tools."""
    try:
        done = subprocess.run(["bash", str(TOOLS_SCRIPT)], capture_output=True, text=True,
                              timeout=1200)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{TOOLS_SCRIPT} did not finish in {exc.timeout:.0f} s") from None
    if done.returncode != 0:
        raise BenchError(f"{TOOLS_SCRIPT} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    try:
        return Tools(Path(found["PERF_ANALYZER"]), found["PERF_LD_LIBRARY_PATH"],
                     Path(found["GENAI_PERF"]), Path(found["AIPERF"]))
    except KeyError as exc:
        raise BenchError(f"{TOOLS_SCRIPT} did not print {exc.args[0]}=...") from None


def _run(cmd: list[str], tools: Tools, log: Path, timeout_s: float, cwd: Path) -> None:
    """Run a tool with its output in ``log``; a failure quotes the end of that log."""
    with log.open("w") as out:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=tools.env(),
                                  cwd=cwd, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise BenchError(f"{Path(cmd[0]).name} ran past {timeout_s:.0f} s; log {log}") from None
    if code != 0:
        raise BenchError(f"{Path(cmd[0]).name} exited {code}; log {log}:\n"
                         f"{log.read_text()[-2000:]}")


# -- perf_analyzer ---------------------------------------------------------------------------


@dataclass
class LoadPoint:
    """One concurrency level as perf_analyzer measured it (times in ms)."""

    mode: str
    concurrency: int
    requests: int  # completed, every one of them
    tokens: int  # streamed tokens
    tokens_per_response: float  # above 1 when streams fell behind
    requests_per_s: float  # over the run: first request sent to last token received
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_ms: float  # per request (last - first response) / (tokens - 1), averaged
    bare_tokens_per_s: float = math.nan
    served_over_bare: float = math.nan  # time per token, served / bare engine
    overhead_ms_per_token: float = math.nan
    rounds: int = 1  # this is the median one of them (by served_over_bare)
    served_over_bare_range: str = ""  # lowest-highest over the rounds


def run_perf_analyzer(tools: Tools, grpc_url: str, mode: str, concurrency: int, requests: int,
                      max_tokens: int, prompt: str, out_dir: Path, model: str = MODEL,
                      data: dict | None = None) -> LoadPoint:
    """Exactly ``requests`` streamed requests at ``concurrency`` (after ``concurrency`` warm-up);
    ``data``: perf_analyzer's input data for ``model`` (default: ``prompt`` for the ensemble)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # end_id -1: no end token, every request runs to max_tokens (absent, the ensemble stops
    # at the tokenizer's end token, as the backend's does)
    data = data or {"data": [{"text_input": [prompt], "max_tokens": [max_tokens],
                              "end_id": [-1], "stream": [True]}]}
    (out_dir / "input.json").write_text(json.dumps(data))
    cmd = [
        str(tools.perf_analyzer), "-m", model, "-u", grpc_url, "-i", "grpc", "--streaming",
        "--input-data", "input.json", "--concurrency-range", str(concurrency),
        # One measurement of a fixed request count: bounded time, no stability retries
        # (shared CPUs never look stable); -s 999 is how genai-perf asks for the same.
        "--request-count", str(requests), "--warmup-request-count", str(concurrency),
        "--stability-percentage", "999", "--profile-export-file", "export.json",
    ]
    path = out_dir / "export.json"
    for attempt in range(PA_ATTEMPTS):
        path.unlink(missing_ok=True)  # perf_analyzer refuses to write over an export
        _run(cmd, tools, out_dir / "perf_analyzer.log", PA_TIMEOUT_S, out_dir)
        try:
            export = json.loads(path.read_text())
            break
        except json.JSONDecodeError as exc:
            # perf_analyzer 2.51 exports every output the model declares, reading memory it
            # never set for those a response lacks (log-probs not asked for); a NaN there
            # stops rapidjson's writer, and the file ends at its last full 64 KiB buffer
            # (seen: 0 and 768 KiB), exit status 0. Its measurement is lost: run it again.
            print(f"perf_analyzer's profile export {path} is cut short ({exc}); "
                  f"attempt {attempt + 1} of {PA_ATTEMPTS}", file=sys.stderr, flush=True)
    else:
        raise BenchError(f"perf_analyzer wrote no readable profile export in {PA_ATTEMPTS} "
                         f"runs; its log: {out_dir / 'perf_analyzer.log'}")
    return summarize_export(export, mode, concurrency, max_tokens)


def summarize_export(export: dict, mode: str, concurrency: int, max_tokens: int) -> LoadPoint:
    """TTFT, ITL and throughput from the per-request timestamps (ns) perf_analyzer exported;
    tokens are counted from each response's ``output_ids`` (a stream that fell behind gets
    several in one response)."""
    experiment = next((e for e in export["experiments"]
                       if e["experiment"] == {"mode": "concurrency", "value": concurrency}), None)
    if experiment is None or not experiment["requests"]:
        raise BenchError(f"perf_analyzer exported no requests at concurrency {concurrency}")
    requests = experiment["requests"]
    counts = [streamed_tokens(r) for r in requests]
    short = [n for n in counts if n != max_tokens]
    if short:
        raise BenchError(f"{len(short)} of {len(requests)} requests streamed {short[0]} tokens, "
                         f"not max_tokens={max_tokens} (failed or cut short)")
    start = min(r["timestamp"] for r in requests)
    span_s = (max(r["response_timestamps"][-1] for r in requests) - start) / 1e9
    ttft = sorted((r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in requests)
    itl = [(r["response_timestamps"][-1] - r["response_timestamps"][0]) / 1e6 / (max_tokens - 1)
           for r in requests] if max_tokens > 1 else [math.nan]
    tokens, responses = sum(counts), sum(len(r["response_timestamps"]) for r in requests)
    return LoadPoint(
        mode=mode, concurrency=concurrency, requests=len(requests), tokens=tokens,
        tokens_per_response=tokens / responses,
        requests_per_s=len(requests) / span_s, tokens_per_s=tokens / span_s,
        ttft_p50_ms=statistics.median(ttft), ttft_p99_ms=_percentile(ttft, 99),
        itl_ms=statistics.fmean(itl),
    )


def streamed_tokens(request: dict) -> int:
    """Tokens of one exported request: the ``output_ids`` of its responses (a response
    without them, e.g. a final flag alone, adds none; an export without outputs, one a
    response)."""
    outputs = request.get("response_outputs")
    if outputs is None:
        return len(request["response_timestamps"])
    return sum(int(np.size(o.get("output_ids", []))) for o in outputs)


def _percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]


# -- genai-perf and aiperf -------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    """Where a cluster serves: Triton gRPC and HTTP (host:port), the OpenAI API (its base URL
    without ``/v1``; None: not running) and the model name that API serves."""

    grpc: str
    http: str
    openai: str | None
    served_model: str


@dataclass
class GenaiPoint:
    """A genai-perf or aiperf summary at one concurrency, over one API."""

    tool: str
    api: str
    mode: str
    concurrency: int
    requests: int
    # From the tool's raw export: the tokens streamed (generate, kserve: output_ids; aiperf:
    # the server's usage count), or for genai-perf over completions/chat, which exports only
    # text, the chunks with text (a chunk may carry several tokens, or none of a partial
    # character).
    streamed: int
    requests_per_s: float
    tokens_per_s: float  # as the tool counts tokens: by re-tokenizing the text it received
    ttft_avg_ms: float
    ttft_p99_ms: float
    itl_avg_ms: float
    output_len_avg: float  # retokenized, so it need not equal max_tokens


def _tool_target(api: str, where: Endpoints, max_tokens: int) -> list[str]:
    """The model, endpoint and URL arguments genai-perf and aiperf share for ``api``."""
    # Every request runs to max_tokens, as the bare engine's do (a random prompt may
    # otherwise draw the end id at once, and the tools drop an empty request): on the
    # ensemble, whose preprocessing fills in the tokenizer's end id, min_tokens =
    # max_tokens (the tools send an extra input "end_id:-1" as the string "-1"); on the
    # OpenAI API, ignore_eos.
    ensemble = ["--extra-inputs", f"min_tokens:{max_tokens}"]
    if api == "kserve":
        return ["-m", MODEL, "--endpoint-type", "kserve", "-u", where.grpc, *ensemble]
    if api == "generate":
        return ["-m", MODEL, "--endpoint-type", "generate", "-u", where.http,
                "--endpoint", f"v2/models/{MODEL}/generate_stream", *ensemble]
    if where.openai is None:
        raise BenchError(f"the {api} API needs the cluster's OpenAI-compatible server")
    return ["-m", where.served_model, "--endpoint-type", api, "-u", where.openai,
            "--extra-inputs", "ignore_eos:true"]


def _load_args(model_dir: Path, concurrency: int, requests: int, max_tokens: int) -> list[str]:
    """The load arguments genai-perf and aiperf share."""
    return ["--streaming", "--tokenizer", str(model_dir), "--concurrency", str(concurrency),
            # perf_analyzer 2.51 hangs when fewer warm-up requests than streams are asked for
            "--request-count", str(requests), "--warmup-request-count", str(concurrency),
            "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(max_tokens), "--random-seed", "0"]


def run_genai_perf(tools: Tools, where: Endpoints, model_dir: Path, mode: str, api: str,
                   concurrency: int, requests: int, max_tokens: int, out_dir: Path) -> GenaiPoint:
    out_dir.mkdir(parents=True, exist_ok=True)
    # --verbose: genai-perf otherwise drops perf_analyzer's stdout, the one account of a
    # run that exported no requests.
    cmd = [str(tools.genai_perf), "profile", *_tool_target(api, where, max_tokens),
           *_load_args(model_dir, concurrency, requests, max_tokens),
           "--num-dataset-entries", "8", "--artifact-dir", str(out_dir / "artifacts"),
           "--verbose"]
    log = out_dir / "genai_perf.log"
    _run(cmd, tools, log, GENAI_TIMEOUT_S, out_dir)
    summaries = list((out_dir / "artifacts").glob("*/profile_export_genai_perf.json"))
    if len(summaries) != 1:
        raise BenchError(f"expected one genai-perf summary under {out_dir}, found {summaries}")
    raw = _export(summaries[0].parent / "profile_export.json", log)
    streamed = sum(_streamed(out) for r in raw["experiments"][0]["requests"]
                   for out in r["response_outputs"])
    return _point("genai-perf", api, mode, concurrency, streamed,
                  json.loads(summaries[0].read_text()))


def _export(path: Path, log: Path) -> dict:
    """genai-perf's raw export of one run with requests in it; else an error quoting the
    run's log (perf_analyzer's own output included)."""
    try:
        raw = json.loads(path.read_text())
        if raw["experiments"][0]["requests"]:
            return raw
    except (OSError, ValueError, KeyError, IndexError):
        pass
    raise BenchError(f"genai-perf exported no requests in {path}; log {log}:\n"
                     f"{log.read_text()[-3000:]}")


def run_aiperf(tools: Tools, where: Endpoints, model_dir: Path, mode: str, api: str,
               concurrency: int, requests: int, max_tokens: int, out_dir: Path) -> GenaiPoint:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(tools.aiperf), "profile", *_tool_target(api, where, max_tokens),
           *_load_args(model_dir, concurrency, requests, max_tokens),
           "--ui-type", "none", "--artifact-dir", str(out_dir / "artifacts")]
    _run(cmd, tools, out_dir / "aiperf.log", GENAI_TIMEOUT_S, out_dir)
    artifacts = out_dir / "artifacts"
    records = [json.loads(line) for line in
               (artifacts / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    # aiperf keeps the server's own count (usage) next to its re-tokenized one
    streamed = sum(int(r["metrics"]["usage_completion_tokens"]["value"]) for r in records
                   if r["metadata"]["benchmark_phase"] == "profiling")
    return _point("aiperf", api, mode, concurrency, streamed,
                  json.loads((artifacts / "profile_export_aiperf.json").read_text()))


def _point(tool: str, api: str, mode: str, concurrency: int, streamed: int,
           summary: dict) -> GenaiPoint:
    return GenaiPoint(
        tool=tool, api=api, mode=mode, concurrency=concurrency,
        requests=int(summary["request_count"]["avg"]), streamed=streamed,
        requests_per_s=summary["request_throughput"]["avg"],
        tokens_per_s=summary["output_token_throughput"]["avg"],
        ttft_avg_ms=summary["time_to_first_token"]["avg"],
        ttft_p99_ms=summary["time_to_first_token"]["p99"],
        itl_avg_ms=summary["inter_token_latency"]["avg"],
        output_len_avg=summary["output_sequence_length"]["avg"],
    )


def _streamed(output: dict) -> int:
    """What one exported response streamed: kserve, its output_ids; server-sent events:
    generate, each event's output_ids; completions and chat, one per event with a choice's
    text (or delta content)."""
    if "response" not in output:
        return int(np.size(output.get("output_ids", [])))
    events = [json.loads(line.removeprefix("data:")) for line in output["response"].splitlines()
              if line.removeprefix("data:").strip().startswith("{")]
    return sum(int(np.size(e["output_ids"])) if "output_ids" in e
               else any(c.get("text") or (c.get("delta") or {}).get("content")
                        for c in e.get("choices", []))
               for e in events)


# -- the bare engine ---------------------------------------------------------------------------


class BareEngine:
    """``reference.generate`` in this process, one thread like a serving node: the engine's
    own tokens/s, measured right before and right after each served point (this machine's
    speed drifts by tens of percent within minutes)."""

    def __init__(self, model_dir: Path, prompt: str, max_tokens: int,
                 machine: Devices | None = None, min_s: float = 0.5) -> None:
        """``machine``: the cores it runs on (the T-node's), else where this process runs."""
        import torch

        from orchestrator.engine.tokenizer import load_tokenizer
        from orchestrator.engine.torch_engine import load_engine

        torch.set_num_threads(1)
        self.engine = load_engine(model_dir)
        self.prompt_ids = load_tokenizer(model_dir).encode(prompt).ids
        self.max_tokens, self.min_s, self.machine = max_tokens, min_s, machine

    def tokens_per_s(self, batch: int) -> float:
        from orchestrator.engine.reference import generate

        prompts = [self.prompt_ids] * batch
        with on_machine(self.machine):
            generate([self.engine], prompts, self.max_tokens)  # warm-up
            runs, begin = 0, time.perf_counter()
            while runs < 2 or time.perf_counter() - begin < self.min_s:
                generate([self.engine], prompts, self.max_tokens)
                runs += 1
            return runs * batch * self.max_tokens / (time.perf_counter() - begin)


def median_round(rounds: list[LoadPoint]) -> LoadPoint:
    """The round whose served/bare ratio is the median (a measured point, not a blend of
    several), with the spread of the ratio over all rounds."""
    ordered = sorted(rounds, key=lambda p: p.served_over_bare)
    ratios = [p.served_over_bare for p in ordered]
    return replace(ordered[(len(ordered) - 1) // 2], rounds=len(rounds),
                   served_over_bare_range=f"{ratios[0]:.2f}-{ratios[-1]:.2f}")


def compare_to_bare(point: LoadPoint, before: float, after: float) -> None:
    """``before``/``after``: the bare engine's tokens/s around the point; their mean time
    per token is the point's bare figure."""
    point.bare_tokens_per_s = 2 / (1 / before + 1 / after)
    point.served_over_bare = point.bare_tokens_per_s / point.tokens_per_s
    point.overhead_ms_per_token = 1e3 / point.tokens_per_s - 1e3 / point.bare_tokens_per_s


# -- output ----------------------------------------------------------------------------------


LOAD_COLUMNS = {
    "mode": "mode", "concurrency": "conc", "requests": "requests", "tokens_per_s": "tok/s",
    "tokens_per_response": "tok/resp", "requests_per_s": "req/s", "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "itl_ms": "ITL ms", "bare_tokens_per_s": "bare tok/s",
    "served_over_bare": "served/bare time per token",
    "served_over_bare_range": "over rounds",
    "overhead_ms_per_token": "overhead ms/token",
}
GENAI_COLUMNS = {
    "tool": "tool", "api": "API", "mode": "mode", "concurrency": "conc", "requests": "requests",
    "tokens_per_s": "tok/s",
    "ttft_avg_ms": "TTFT avg ms", "ttft_p99_ms": "TTFT p99 ms", "itl_avg_ms": "ITL avg ms",
    "output_len_avg": "output len (retokenized)",
}


# -- the command -----------------------------------------------------------------------------


@contextmanager
def _frontend(args, mode: str, model_dir: Path, machines: Machines | None
              ) -> Iterator[Endpoints]:
    """Where a fresh local cluster for ``mode`` serves (its OpenAI API only if a run needs
    it), or the one ``--url`` names."""
    if args.url:
        yield Endpoints(args.url, args.http_url, args.openai_url, model_dir.name)
        return
    from orchestrator.cluster.launcher import Cluster

    devices = None
    if machines is not None:
        devices = {"decode0": machines.token, "frontend": machines.host}
        if mode == "disaggregated":
            devices["prefill0"] = machines.host
    run_dir = args.out / "cluster" / mode
    with Cluster.up(model_dir, colocated=mode == "colocated", run_dir=run_dir,
                    devices=devices, openai=_needs_openai(args)) as cluster:
        yield Endpoints(cluster.frontend.grpc_url, cluster.frontend.http_url,
                        cluster.openai.url.removesuffix("/v1") if cluster.openai else None,
                        model_dir.name)


def _tool_runs(args) -> list[tuple[Callable[..., GenaiPoint], str]]:
    """(run_genai_perf or run_aiperf, API): each tool run per mode, none at concurrency 0."""
    if not args.genai_concurrency:
        return []
    return ([(run_genai_perf, api) for api in args.genai_apis]
            + ([(run_aiperf, "completions")] if args.aiperf else []))


def _needs_openai(args) -> bool:
    return any(api in OPENAI_APIS for _, api in _tool_runs(args))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench serving",
                                     description=__doc__.splitlines()[0])
    model_arguments(parser, "llama", "tiny")
    parser.add_argument("--url", help="gRPC host:port of a running frontend (no local cluster)")
    parser.add_argument("--http-url", help="its HTTP host:port (genai-perf), with --url")
    parser.add_argument("--openai-url", help="its OpenAI-compatible API, http://host:port "
                        "(genai-perf completions/chat, aiperf), with --url")
    parser.add_argument("--modes", nargs="+", choices=["disaggregated", "colocated"],
                        default=["disaggregated", "colocated"])
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="concurrent streams (default 1..8; --cpu: 1 16 64)")
    parser.add_argument("--requests", type=int, default=12,
                        help="requests per concurrent stream at each level")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 32; --cpu: "
                        "220)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--genai-concurrency", type=int, default=4,
                        help="genai-perf's one concurrency (0: skip genai-perf and aiperf)")
    parser.add_argument("--genai-apis", nargs="+", choices=GENAI_APIS, default=list(GENAI_APIS),
                        help="the APIs genai-perf loads, one run each")
    parser.add_argument("--aiperf", action="store_true",
                        help="also run aiperf over the OpenAI completions API")
    parser.add_argument("--out", type=Path, default=Path("bench_out/serving"))
    parser.add_argument("--breakdown", action="store_true",
                        help="instead: where one token's time goes at concurrency 1 (engine, "
                        "pipeline, T-node, frontend, ensemble) and one stage hop vs NIXL")
    parser.add_argument("--breakdown-requests", type=int, default=20,
                        help="requests per layer in the breakdown")
    parser.add_argument("--breakdown-mode", choices=["colocated", "disaggregated"],
                        default="colocated",
                        help="the breakdown's cluster: colocated 1T, or 1P+1T (its T-node "
                        "layer left out: a T-node alone cannot prefill)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of (bare, served, bare) per point; the median round "
                        "is reported, with the ratio's spread")
    parser.add_argument("--pin", action="store_true",
                        help="the T-node alone on the last core, the rest (frontend, P-node, "
                        "perf_analyzer) on the others; the bare engine on the T-node's core")
    parser.add_argument("--cpu", action="store_true",
                        help="instead: the cluster's CPU per streamed token by process role, "
                        "an emulated 1P+1T cluster on --profile (clients/serving_cpu.py)")
    parser.add_argument("--profile", default="splitwise-llama2-70b-h100",
                        help="--cpu: the emulated engine's profile")
    parser.add_argument("--batch", type=int, default=64, help="--cpu: the T-node's max batch")
    parser.add_argument("--frontend-instances", type=int, default=1,
                        help="--cpu: orchestrator model instances in the frontend")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="--cpu: tokens per streamed response")
    args = parser.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = [1, 16, 64] if args.cpu else list(range(1, 9))
    if args.max_tokens is None:
        args.max_tokens = 220 if args.cpu else 32
    if args.cpu:
        return _cpu(args)
    if args.breakdown:
        return _breakdown(args)
    if bool(args.url) != bool(args.http_url):
        parser.error("--url and --http-url go together (perf_analyzer: gRPC, genai-perf: HTTP)")
    if args.url and _needs_openai(args) and not args.openai_url:
        parser.error("--url with the OpenAI APIs (completions, chat, --aiperf) needs "
                     "--openai-url; or --genai-apis generate kserve")
    if args.url and not args.model:
        parser.error("--url needs --model: the served model's folder (tokenizer, bare engine)")
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 2 or args.rounds < 1:
        parser.error("need --concurrency >= 1, --requests >= 1, --rounds >= 1 and "
                     "--max-tokens >= 2")
    modes = ["external"] if args.url else args.modes
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        tools = install_tools()
        model_dir = (args.model or dummy_model(args.out, args.arch, args.preset)).resolve()
        machines = Machines.of_this_host() if args.pin and not args.url else None
        if machines is not None:  # perf_analyzer, started from here, runs there too
            machines.host.pin()
        bare = BareEngine(model_dir, args.prompt, args.max_tokens,
                          machines.token if machines else None)
        points, genai = [], []
        for mode in modes:
            with _frontend(args, mode, model_dir, machines) as where:
                for c in args.concurrency:
                    rounds = []
                    for r in range(args.rounds):  # bare, served, bare: a ratio per round
                        before = bare.tokens_per_s(c)
                        rounds.append(run_perf_analyzer(
                            tools, where.grpc, mode, c, args.requests * c, args.max_tokens,
                            args.prompt, args.out / mode / f"c{c}" / f"round{r}"))
                        compare_to_bare(rounds[-1], before, bare.tokens_per_s(c))
                    points.append(median_round(rounds))
                    print(f"{mode} c={c}: {points[-1].tokens_per_s:.0f} tok/s", flush=True)
                c = args.genai_concurrency
                for run, api in _tool_runs(args):
                    tool = run.__name__.removeprefix("run_")
                    genai.append(run(tools, where, model_dir, mode, api, c, args.requests * c,
                                     args.max_tokens, args.out / mode / f"{tool}-{api}"))
    except (BenchError, ServerError, ValueError, OSError) as exc:
        print(f"dejavu bench serving: {exc}", file=sys.stderr)
        return 1
    report(args, points, genai)
    return 0


def _breakdown(args) -> int:
    from clients.breakdown import run_breakdown

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = (args.model or dummy_model(args.out, args.arch, args.preset)).resolve()
        machines = Machines.of_this_host() if args.pin else None
        breakdown = run_breakdown(model_dir, args.prompt, args.max_tokens,
                                  args.breakdown_requests, out, machines,
                                  colocated=args.breakdown_mode == "colocated")
    except (ServerError, RuntimeError, ValueError, OSError) as exc:
        print(f"dejavu bench serving --breakdown: {exc}", file=sys.stderr)
        return 1
    write_csv(out / "breakdown.csv", breakdown.rows())
    print(breakdown.report(args.max_tokens, args.breakdown_requests))
    print(f"wrote {out}/breakdown.csv")
    return 0


def _cpu(args) -> int:
    from clients.serving_cpu import COLUMNS, run_cpu

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = (args.model or dummy_model(args.out, args.arch, args.preset)).resolve()
        rows = run_cpu(model_dir, out, args.concurrency, args.max_tokens, args.batch,
                       args.profile, args.frontend_instances, args.stream_interval)
    except (ServerError, RuntimeError, ValueError, OSError) as exc:
        print(f"dejavu bench serving --cpu: {exc}", file=sys.stderr)
        return 1
    write_csv(out / "cpu.csv", rows)
    print(f"\n{args.profile}, batch {args.batch}, {args.max_tokens} tokens per stream, "
          f"{args.frontend_instances} orchestrator instance(s), stream interval "
          f"{args.stream_interval}; ms of CPU per streamed token:\n")
    print(markdown(rows, COLUMNS))
    print(f"wrote {out}/cpu.csv")
    return 0


def report(args, points: list[LoadPoint], genai: list[GenaiPoint]) -> None:
    print_table("perf_analyzer (gRPC streaming) vs the bare engine", points, LOAD_COLUMNS)
    write_csv(args.out / "perf_analyzer.csv", points)
    if genai:
        print_table("genai-perf and aiperf, unchanged, over each API", genai, GENAI_COLUMNS)
        write_csv(args.out / "genai_perf.csv", genai)
    print(f"wrote {args.out}/perf_analyzer.csv" + (", genai_perf.csv" if genai else ""))
    print(f"\nprompt {args.prompt!r}, max_tokens {args.max_tokens}, "
          f"{args.requests} requests per concurrent stream; bare = reference.generate at "
          "batch = concurrency, one thread.\n")
    print(markdown(points, LOAD_COLUMNS))
    if genai:
        print("\ngenai-perf and aiperf count tokens by re-tokenizing the streamed text (output "
              f"len), not the {args.max_tokens} tokens streamed: their tok/s and ITL scale with "
              "that.\n")
        print(markdown(genai, GENAI_COLUMNS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
