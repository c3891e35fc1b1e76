"""``dejavu bench soak``: a long mixed load while a process of every role is killed in turn.

One cluster (``Cluster.up``): a P-node, a depth-2 token pipeline with KV replicas and a warm
spare, the frontend and the OpenAI-compatible API. For ``--minutes`` (or ``--seconds``),
``--clients`` threads send one request after another, each of a kind drawn at random
(seeded, :data:`LOAD`):

- greedy requests, streamed and not, over gRPC and HTTP to the ensemble and through the
  OpenAI API: every token checked against the single-process reference;
- sampled requests (temperature, top-k, a seed): checked for their length;
- early leavers that close their stream after a few tokens: over gRPC to the ensemble, to
  the frontend's ``orchestrator`` model (its cancel frees the T-node) and over HTTP; the
  tokens they saw are checked;
- bad requests (:data:`BAD`): each must be refused as a client error (HTTP 400, gRPC
  INVALID_ARGUMENT).

Meanwhile the roles are killed in turn every ``--kill-every`` seconds, as ``dejavu chaos
kill`` does (SIGKILL of the process group): the P-node, T-stage 1, the head stage 0, the
frontend, the controller, the supervisor. After each kill the bench waits, with a deadline,
until the cluster is whole again (a new process in the role, every node ready and alive in
the controller's view, every pipeline serving, the supervisor and its watchdog running).

A request is *lost* when it ends in an error or short of its tokens; one cut because the
frontend it was connected to was killed is sent again once the frontend is back (counted as
a retry), as any client of a restarted server would. *Duplicated*: more tokens than it
asked for. *Mismatch*: tokens other than the reference's. Every ``--sample-s`` each role's
processes (a node's whole process group: tritonserver and its Python stubs) are read from
/proc: RSS, threads, open fds, and the node's /dev/shm regions.

Output in ``--out``: ``soak_requests.csv`` (per kind), ``soak_kills.csv``,
``soak_procs.csv`` (every sample), ``soak_roles.csv`` (per role: first, last, max),
``soak.png`` (the samples over time, kills marked), ``soak.md`` (the tables) and the
tables printed. Exit 1 if a request was lost, duplicated or mismatched, a bad request was
not refused, the cluster did not come back after a kill, or a node still holds anything at
the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clients.common import (
    PROMPTS,
    dummy_model,
    markdown,
    model_arguments,
    print_table,
    process_groups,
    reference,
    write_csv,
)
from clients.provenance import save_figure, stamp

KILLS = ("prefill0", "decode0s1", "decode0s0", "frontend", "controller", "supervisor")
LOAD = {  # kind -> weight
    "grpc_stream": 3, "grpc": 2, "http_stream": 2, "http": 2, "openai_stream": 1,
    "openai": 1, "sampled": 1, "leave_grpc": 1, "leave_orchestrator": 1, "leave_http": 1,
    "bad": 2,
}
MAX_SEQ_LEN = 256
LONG = 200  # tokens an early leaver asks for (it leaves long before)
MAX_RETRIES = 3
GOOD = ("served", "left", "refused")
BAD_OUTCOMES = ("lost", "duplicated", "mismatch", "not_refused")


class Short(RuntimeError):
    """A request ended without error but with fewer tokens than it asked for."""


@dataclass
class Target:
    """Where the clients send and what they expect back."""

    grpc: str
    http: str
    openai: str
    model_name: str
    secret: bytes
    prompt_ids: list[list[int]]
    expected: list[list[int]]  # greedy, LONG tokens per prompt
    expected_text: list[str]  # the OpenAI API's: max_tokens, ending at eos, decoded
    max_tokens: int


# -- the load ----------------------------------------------------------------------------------


def _greedy(ids: list[int], want: list[int]) -> tuple[str, str]:
    if len(ids) > len(want):
        return "duplicated", f"{len(ids)} tokens for {len(want)}"
    if len(ids) < len(want):
        raise Short(f"{len(ids)} of {len(want)} tokens")
    return ("served", "") if ids == want else ("mismatch", f"got {ids}, want {want}")


def _ensemble(protocol: str, stream: bool) -> Callable:
    def run(t: Target, rng: random.Random) -> tuple[str, str]:
        from clients.generate import stream_grpc, stream_http

        p = rng.randrange(len(PROMPTS))
        call = stream_grpc if protocol == "grpc" else stream_http
        url = t.grpc if protocol == "grpc" else t.http
        # end_id -1: no end token, as the reference (LONG tokens per prompt)
        chunks = call(url, PROMPTS[p], stream=stream, max_tokens=t.max_tokens, end_id=-1)
        return _greedy([i for c in chunks for i in c.ids], t.expected[p][: t.max_tokens])

    return run


def _sampled(t: Target, rng: random.Random) -> tuple[str, str]:
    from clients.generate import stream_grpc

    chunks = stream_grpc(t.grpc, PROMPTS[rng.randrange(len(PROMPTS))],
                         max_tokens=t.max_tokens, end_id=-1, temperature=0.9, top_k=20,
                         seed=rng.randrange(2**31))
    ids = [i for c in chunks for i in c.ids]
    if len(ids) < t.max_tokens:
        raise Short(f"{len(ids)} of {t.max_tokens} tokens")
    return ("served", "") if len(ids) == t.max_tokens else ("duplicated", f"{len(ids)} tokens")


def _openai(stream: bool) -> Callable:
    def run(t: Target, rng: random.Random) -> tuple[str, str]:
        p = rng.randrange(len(PROMPTS))
        body = {"model": t.model_name, "prompt": PROMPTS[p], "max_tokens": t.max_tokens,
                "temperature": 0, "stream": stream}
        request = urllib.request.Request(f"{t.openai}/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            if stream:
                events = [line[len(b"data:"):].strip() for line in response
                          if line.startswith(b"data:")]
                if events[-1:] != [b"[DONE]"]:
                    raise Short("the event stream ended without [DONE]")
                parts = [json.loads(e)["choices"] for e in events[:-1]]
                text = "".join(c[0]["text"] for c in parts if c)
            else:
                text = json.loads(response.read())["choices"][0]["text"]
        want = t.expected_text[p]
        if text == want:
            return "served", ""
        if text.startswith(want):
            return "duplicated", f"{text!r} for {want!r}"
        if want.startswith(text):
            raise Short(f"{text!r} of {want!r}")
        return "mismatch", f"{text!r}, want {want!r}"

    return run


def _leaver(how: str) -> Callable:
    def run(t: Target, rng: random.Random) -> tuple[str, str]:
        from clients.breakdown import stream_orchestrator
        from clients.generate import stream_grpc, stream_http

        p, after = rng.randrange(len(PROMPTS)), rng.randint(1, 8)
        if how == "orchestrator":
            stream = stream_orchestrator(t.grpc, t.secret, t.prompt_ids[p], LONG)
        else:
            call = stream_grpc if how == "grpc" else stream_http
            stream = call(t.grpc if how == "grpc" else t.http, PROMPTS[p], max_tokens=LONG,
                          end_id=-1)
        ids: list[int] = []
        with contextlib.closing(stream):  # leaving closes the stream: the request is cancelled
            for chunk in stream:
                ids.extend(chunk if how == "orchestrator" else chunk.ids)
                if len(ids) >= after:
                    break
        if len(ids) < after:
            raise Short(f"the stream ended after {len(ids)} tokens")
        return ("left", "") if ids == t.expected[p][: len(ids)] else \
            ("mismatch", f"got {ids} before leaving")

    return run


def _http_bad(body: bytes) -> Callable[[Target], tuple[int | None, str]]:
    def send(t: Target) -> tuple[int | None, str]:
        request = urllib.request.Request(f"http://{t.http}/v2/models/ensemble/generate", body)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()[:200].decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()[:200].decode(errors="replace")

    return send


def _grpc_bad(t: Target) -> tuple[int | None, str]:
    from clients.generate import GenerateError, stream_grpc

    try:
        list(stream_grpc(t.grpc, "Hi", max_tokens=-1))
    except GenerateError as exc:
        # An error inside the stream carries no gRPC status (Triton 2.51): the server's
        # answer. UNAVAILABLE and the like: the connection's, the frontend is away.
        if exc.status is not None and "INVALID_ARGUMENT" not in exc.status:
            raise
        return 400, str(exc)[:200]
    return 200, "answered"


def _openai_bad(t: Target) -> tuple[int | None, str]:
    body = json.dumps({"model": t.model_name, "prompt": "Hi", "max_tokens": 4,
                       "temperature": -1}).encode()
    request = urllib.request.Request(f"{t.openai}/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, "answered"
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:200].decode(errors="replace")


BAD: dict[str, Callable[[Target], tuple[int | None, str]]] = {
    "nan_temperature": _http_bad(b'{"text_input": "Hi", "max_tokens": 8, "temperature": NaN}'),
    "no_max_tokens": _http_bad(b'{"text_input": "Hi"}'),
    "unknown_input": _http_bad(b'{"text_input": "Hi", "max_tokens": 8, "beam_width": 2}'),
    "end_id_outside_vocab": _http_bad(b'{"text_input": "Hi", "max_tokens": 8, '
                                      b'"end_id": 1000000000}'),
    "huge_prompt": _http_bad(json.dumps({"text_input": "word " * 200_000,
                                         "max_tokens": 8}).encode()),  # 1 MB
    "grpc_negative_max_tokens": _grpc_bad,
    "openai_negative_temperature": _openai_bad,
}


def _bad(t: Target, rng: random.Random) -> tuple[str, str]:
    name = rng.choice(list(BAD))
    code, said = BAD[name](t)
    if code is not None and 400 <= code < 500:
        return "refused", name
    if code is not None and code >= 500 and code != 503:
        return "not_refused", f"{name}: {code} {said}"
    if code == 503:
        raise Short(f"{name}: 503 {said}")  # nothing to serve it: the frontend is away
    return "not_refused", f"{name}: {code} {said}"


KINDS: dict[str, Callable[[Target, random.Random], tuple[str, str]]] = {
    "grpc_stream": _ensemble("grpc", True), "grpc": _ensemble("grpc", False),
    "http_stream": _ensemble("http", True), "http": _ensemble("http", False),
    "openai_stream": _openai(True), "openai": _openai(False), "sampled": _sampled,
    "leave_grpc": _leaver("grpc"), "leave_orchestrator": _leaver("orchestrator"),
    "leave_http": _leaver("http"), "bad": _bad,
}
assert set(KINDS) == set(LOAD)


@dataclass
class Outcome:
    kind: str
    status: str  # served | left | refused | lost | duplicated | mismatch | not_refused
    at_s: float  # since the load started
    latency_s: float
    retries: int
    detail: str = ""


# -- chaos -------------------------------------------------------------------------------------


@dataclass
class Kill:
    role: str
    at_s: float  # since the load started
    back_s: float | None  # kill -> the cluster whole again (None: not within the deadline)
    old_pid: int
    new_pid: int | None = None
    error: str = ""


def _pid(run_dir: Path, role: str) -> int | None:
    from orchestrator.cluster.chaos import targets
    from orchestrator.cluster.launcher import read_state

    return targets(read_state(run_dir), run_dir).get(role, {}).get("pid")


def whole(run_dir: Path) -> bool:
    """Every node ready and alive in the controller's view, every pipeline serving, the
    supervisor and its watchdog running."""
    from orchestrator.cluster.launcher import controller_view, read_state
    from orchestrator.cluster.tritonserver import alive, is_ready
    from orchestrator.cluster.watchdog import read_pid

    state = read_state(run_dir)
    if not all(is_ready(n["http"]) for n in state["nodes"]):
        return False
    view = controller_view(state)
    if "error" in view or any(n["controller"] not in ("alive", "-") for n in state["nodes"]):
        return False
    if any(p["state"] != "serving" for p in view.get("pipelines", {}).values()):
        return False
    return all((pid := read_pid(run_dir, role)) and alive(pid)
               for role in ("supervisor", "watchdog"))


class Chaos(threading.Thread):
    """Kills ``roles`` in turn every ``every_s`` seconds until ``until``; after each kill
    waits (up to ``back_timeout_s``) until the cluster is whole again."""

    def __init__(self, run_dir: Path, roles: list[str], every_s: float, start: float,
                 until: float, back_timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.roles, self.every_s = run_dir, roles, every_s
        self.start_t, self.until, self.back_timeout_s = start, until, back_timeout_s
        self.kills: list[Kill] = []
        self.frontend_out: list[list[float]] = []  # [killed, back] (monotonic), back: inf
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def disturbed(self, since: float) -> bool:
        """Was the frontend killed or away at any time from ``since`` until now?"""
        with self.lock:
            return any(killed <= time.monotonic() and back >= since
                       for killed, back in self.frontend_out)

    def wait_for_frontend(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if all(back != float("inf") for _, back in self.frontend_out):
                    return
            time.sleep(0.2)

    def run(self) -> None:
        from orchestrator.cluster.chaos import kill, targets
        from orchestrator.cluster.launcher import read_state

        turn = 0
        while not self.stop.wait(self.every_s) and time.monotonic() + 10 < self.until:
            role = self.roles[turn % len(self.roles)]
            turn += 1
            target = targets(read_state(self.run_dir), self.run_dir)[role]
            killed = time.monotonic()
            if role == "frontend":
                with self.lock:
                    self.frontend_out.append([killed, float("inf")])
            record = Kill(role, round(killed - self.start_t, 1), None, target["pid"])
            print(f"soak {record.at_s:7.1f} s: kill {role} (pid {target['pid']})", flush=True)
            try:
                kill(target, signal.SIGKILL)
                record.back_s, record.new_pid = self._back(role, target["pid"], killed)
            except Exception as exc:  # noqa: BLE001  (reported: the cluster did not come back)
                record.error = f"{type(exc).__name__}: {exc}"[:300]
            if role == "frontend":
                with self.lock:
                    self.frontend_out[-1][1] = time.monotonic()
            self.kills.append(record)
            print(f"soak: {role} back after {record.back_s} s {record.error}", flush=True)
            if record.back_s is None:
                return  # the cluster is not whole: further kills would measure nothing

    def _back(self, role: str, old_pid: int, killed: float) -> tuple[float, int]:
        from orchestrator.cluster.tritonserver import alive

        deadline = killed + self.back_timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):  # state being rewritten
                pid = _pid(self.run_dir, role)
                if pid not in (None, old_pid) and alive(pid) and whole(self.run_dir):
                    return round(time.monotonic() - killed, 1), pid
            time.sleep(0.5)
        raise TimeoutError(f"the cluster was not whole {self.back_timeout_s:.0f} s after the "
                           f"kill of {role}")


# -- /proc -------------------------------------------------------------------------------------


def roles(run_dir: Path) -> dict[str, tuple[int, list[Path]]]:
    """Each role's process group leader and its /dev/shm regions (nodes only)."""
    from orchestrator.cluster.chaos import targets
    from orchestrator.cluster.launcher import read_state
    from orchestrator.cluster.shm_namespace import ShmNamespace
    from orchestrator.cluster.tritonserver import shm_regions

    state = read_state(run_dir)
    namespace = ShmNamespace.from_state(state)
    found = {name: (t["pid"], shm_regions(t["shm_prefix"], namespace)
                    if t.get("shm_prefix") else [])
             for name, t in targets(state, run_dir).items() if t.get("pid")}
    if (state.get("openai") or {}).get("pid"):
        found["openai"] = (state["openai"]["pid"], [])
    return found


def _shm_bytes(regions: list[Path]) -> int:
    total = 0
    for path in regions:
        with contextlib.suppress(OSError):
            total += path.stat().st_blocks * 512  # pages in use, not the nominal size
    return total


class Sampler(threading.Thread):
    def __init__(self, run_dir: Path, every_s: float, start: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.every_s, self.start_t = run_dir, every_s, start
        self.rows: list[dict] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        try:
            leaders = roles(self.run_dir)
        except (OSError, ValueError):
            return  # the state file is being rewritten
        groups = process_groups()
        at = round(time.monotonic() - self.start_t, 1)
        for role, (pid, regions) in sorted(leaders.items()):
            g = groups.get(pid)
            if g is None:
                continue  # killed, not started again yet
            self.rows.append({"t_s": at, "role": role, "pid": pid, "procs": g["processes"],
                              "rss_mb": round(g["rss_kb"] / 1024, 1), "threads": g["threads"],
                              "fds": g["fds"], "shm_mb": round(_shm_bytes(regions) / 2**20, 1)})

    def run(self) -> None:
        while True:
            self.sample()
            if self.stop.wait(self.every_s):
                return


def role_summary(samples: list[dict]) -> list[dict]:
    """Per role: processes seen (incarnations), and RSS, threads, fds, shm at the first
    sample, the last, and their maximum."""
    out = []
    for role in sorted({s["role"] for s in samples}):
        mine = [s for s in samples if s["role"] == role]
        row = {"role": role, "incarnations": len({s["pid"] for s in mine})}
        for key in ("rss_mb", "threads", "fds", "shm_mb"):
            row[f"{key}_first"], row[f"{key}_last"] = mine[0][key], mine[-1][key]
            row[f"{key}_max"] = max(s[key] for s in mine)
        out.append(row)
    return out


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Ledger:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)
        if outcome.status in BAD_OUTCOMES:
            print(f"soak {outcome.at_s:7.1f} s: {outcome.kind} {outcome.status}: "
                  f"{outcome.detail}", flush=True)


def one_request(kind: str, target: Target, chaos: Chaos, seed: int, start: float) -> Outcome:
    """One request of ``kind``; sent again (the same one) when the frontend it was talking
    to was killed meanwhile."""
    began, retries = time.monotonic(), 0
    while True:
        attempt = time.monotonic()
        try:
            status, detail = KINDS[kind](target, random.Random(seed))
        except Exception as exc:  # noqa: BLE001  (every failure is an outcome to count)
            if chaos.disturbed(attempt) and retries < MAX_RETRIES:
                retries += 1
                chaos.wait_for_frontend(300)
                continue
            status, detail = "lost", f"{type(exc).__name__}: {exc}"[:300]
        return Outcome(kind, status, round(began - start, 1),
                       round(time.monotonic() - began, 3), retries, detail)


def client(target: Target, chaos: Chaos, ledger: Ledger, rng: random.Random, start: float,
           until: float) -> None:
    kinds, weights = list(LOAD), list(LOAD.values())
    while time.monotonic() < until:
        kind = rng.choices(kinds, weights)[0]
        ledger.add(one_request(kind, target, chaos, rng.randrange(2**31), start))


def held(run_dir: Path, secret: bytes) -> dict[str, float]:
    """What requests hold: each T-stage's own ``held`` report, the P-node's staging blocks."""
    from clients.common import metric
    from orchestrator.cluster.launcher import read_state
    from orchestrator.control.client import ControlClient

    state = read_state(run_dir)
    control = ControlClient(secret, 10.0)
    counts: dict[str, float] = {}
    try:
        for node in state["nodes"]:
            if node["role"] == "decode":
                for what, n in json.loads(control.call(node["grpc"], "held")).items():
                    counts[f"{node['name']}.{what}"] = n
            elif node["role"] == "prefill":
                counts[f"{node['name']}.staging_blocks"] = metric(
                    node["metrics"], "dejavu_held", what="staging_blocks")
    finally:
        control.close()
    return counts


def until_nothing_held(run_dir: Path, secret: bytes, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = held(run_dir, secret)
        if not any(counts.values()) or time.monotonic() > deadline:
            return {k: v for k, v in counts.items() if v}
        time.sleep(0.5)


def soak(args, model_dir: Path, target_of: Callable[[object], Target]) -> dict:
    from orchestrator.cluster.launcher import Cluster

    run_dir = (args.out / "cluster").resolve()
    print(f"soak: starting the cluster in {run_dir}", flush=True)
    with Cluster.up(model_dir, prefill=1, decode=1, decode_depth=2, spares=1, run_dir=run_dir,
                    max_seq_len=MAX_SEQ_LEN, max_batch=args.max_batch,
                    dead_after_s=args.timeout_s, controller_timeout_s=args.timeout_s) as cluster:
        target = target_of(cluster)
        wait_whole(run_dir, 120)
        _ensemble("grpc", True)(target, random.Random(0))  # warm-up: every node ran a step
        start = time.monotonic()
        until = start + args.seconds
        chaos = Chaos(run_dir, args.kills, args.kill_every, start, until, args.back_timeout_s)
        sampler = Sampler(run_dir, args.sample_s, start)
        ledger = Ledger()
        rng = random.Random(args.seed)
        clients = [threading.Thread(target=client, daemon=True,
                                    args=(target, chaos, ledger, random.Random(rng.random()),
                                          start, until))
                   for _ in range(args.clients)]
        print(f"soak: {args.clients} clients for {args.seconds:.0f} s, a kill every "
              f"{args.kill_every:.0f} s of {', '.join(args.kills)}", flush=True)
        for thread in [sampler, chaos, *clients]:
            thread.start()
        for thread in clients:
            thread.join(until - time.monotonic() + 600)
        chaos.stop.set()
        chaos.join(args.back_timeout_s + 60)
        sampler.stop.set()
        sampler.join(30)
        served_for = time.monotonic() - start
        whole_at_end = wait_whole(run_dir, args.back_timeout_s)
        left_held = until_nothing_held(run_dir, target.secret)
        sampler.sample()  # after the load: what stays
    return {"outcomes": ledger.outcomes, "kills": chaos.kills, "samples": sampler.rows,
            "served_for_s": served_for, "whole_at_end": whole_at_end, "held": left_held}


def wait_whole(run_dir: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if whole(run_dir):
                return True
        time.sleep(0.5)
    return False


def make_target(args, model_dir: Path) -> Callable[[object], Target]:
    """The reference's tokens now (before the cluster loads), the addresses once it is up."""
    from orchestrator.control.auth import load_secret
    from orchestrator.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    expected = reference(model_dir, PROMPTS, LONG, MAX_SEQ_LEN)
    with_eos = reference(model_dir, PROMPTS, args.max_tokens, MAX_SEQ_LEN, eos)
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]

    def target(cluster) -> Target:
        return Target(cluster.frontend.grpc_url, cluster.frontend.http_url, cluster.openai.url,
                      model_dir.name, load_secret(cluster.secret_file), prompt_ids, expected,
                      [tokenizer.decode(ids) for ids in with_eos], args.max_tokens)

    return target


# -- the report --------------------------------------------------------------------------------

STATUSES = ("served", "left", "refused", "lost", "duplicated", "mismatch", "not_refused")
REQUEST_COLUMNS = {"kind": "kind", "requests": "requests", **{s: s for s in STATUSES},
                   "retries": "retried (frontend killed)", "p50_s": "p50 s", "max_s": "max s"}
KILL_COLUMNS = {"role": "killed", "at_s": "at s", "back_s": "whole again after s",
                "old_pid": "pid", "new_pid": "new pid", "error": "error"}
ROLE_COLUMNS = {"role": "role", "incarnations": "processes",
                **{f"{k}_{w}": f"{label} {w}" for k, label in
                   (("rss_mb", "RSS MB"), ("threads", "threads"), ("fds", "fds"),
                    ("shm_mb", "shm MB")) for w in ("first", "last", "max")}}


def request_rows(outcomes: list[Outcome]) -> list[dict]:
    rows = []
    for kind in [*LOAD, "all"]:
        mine = [o for o in outcomes if kind in ("all", o.kind)]
        counts = Counter(o.status for o in mine)
        latencies = sorted(o.latency_s for o in mine) or [float("nan")]
        rows.append({"kind": kind, "requests": len(mine), **{s: counts[s] for s in STATUSES},
                     "retries": sum(o.retries for o in mine),
                     "p50_s": latencies[len(latencies) // 2], "max_s": latencies[-1]})
    return rows


def plot(samples: list[dict], kills: list[Kill], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharex=True)
    panels = [("rss_mb", "RSS (MB)"), ("threads", "threads"), ("fds", "open fds"),
              ("shm_mb", "/dev/shm (MB)")]
    names = sorted({s["role"] for s in samples})
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for role in names:
            mine = [s for s in samples if s["role"] == role]
            ax.plot([s["t_s"] / 60 for s in mine], [s[key] for s in mine], lw=1, label=role)
        for k in kills:
            ax.axvline(k.at_s / 60, color="grey", lw=0.6, ls="--")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for k in kills:
        axes[0][0].annotate(k.role, (k.at_s / 60, 1.0), xycoords=("data", "axes fraction"),
                            rotation=90, fontsize=6, va="top", ha="right")
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    axes[0][1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def report(args, result: dict) -> bool:
    """Write and print the tables and the plot; whether the soak met every bar."""
    requests = request_rows(result["outcomes"])
    kills = [vars(k) for k in result["kills"]]
    roles_ = role_summary(result["samples"])
    total = requests[-1]
    ok = (all(total[s] == 0 for s in BAD_OUTCOMES) and total["requests"] > 0
          and all(k["back_s"] is not None for k in kills) and result["whole_at_end"]
          and not result["held"])
    write_csv(args.out / "soak_requests.csv", requests)
    write_csv(args.out / "soak_procs.csv", result["samples"])
    write_csv(args.out / "soak_roles.csv", roles_)
    if kills:
        write_csv(args.out / "soak_kills.csv", kills)
    summary = (f"{total['requests']} requests in {result['served_for_s'] / 60:.1f} min, "
               f"{args.clients} clients, {len(kills)} kills: served {total['served']}, left "
               f"early {total['left']}, refused as expected {total['refused']}; lost "
               f"{total['lost']}, duplicated {total['duplicated']}, mismatched "
               f"{total['mismatch']}, bad requests not refused {total['not_refused']}; "
               f"retried after a frontend kill {total['retries']}; cluster whole at the end: "
               f"{result['whole_at_end']}; held at the end: {result['held'] or 'nothing'}")
    plot(result["samples"], result["kills"], args.out / "soak.png",
         f"dejavu bench soak: {total['requests']} requests, {len(kills)} kills "
         f"(lost {total['lost']}, duplicated {total['duplicated']}, mismatched "
         f"{total['mismatch']})")
    tables = [("requests", requests, REQUEST_COLUMNS), ("kills", kills, KILL_COLUMNS),
              ("processes (per role, sampled from /proc)", roles_, ROLE_COLUMNS)]
    md = [summary]
    for title, rows, columns in tables:
        if not rows:
            continue
        md += ["", f"**{title}**", "", markdown(rows, columns)]
        print_table(title, rows, columns, width=220)
    md += ["", f"_{stamp()}_"]
    (args.out / "soak.md").write_text("\n".join(md) + "\n")
    print(summary)
    print(f"{'PASS' if ok else 'FAIL'}; wrote {args.out}/soak.md, soak.png, soak_requests.csv, "
          f"soak_kills.csv, soak_procs.csv, soak_roles.csv")
    return ok


def main(argv: list[str]) -> int:
    from orchestrator.pipeline import DEAD_AFTER_S

    parser = argparse.ArgumentParser(prog="dejavu bench soak",
                                     description=__doc__.splitlines()[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    length.add_argument("--seconds", type=float, help="the same, in seconds (short runs)")
    model_arguments(parser, "llama", "tiny")
    parser.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="tokens of each request that runs to its end")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences per microbatch")
    parser.add_argument("--kill-every", type=float, default=120.0,
                        help="seconds between one kill's recovery and the next kill")
    parser.add_argument("--kills", default=",".join(KILLS),
                        help=f"the roles killed in turn, of {', '.join(KILLS)}")
    parser.add_argument("--back-timeout-s", type=float, default=300.0,
                        help="deadline for the cluster to be whole again after a kill")
    parser.add_argument("--timeout-s", type=float, default=DEAD_AFTER_S,
                        help="heartbeat timeout of the controller and the head")
    parser.add_argument("--sample-s", type=float, default=2.0, help="/proc sampling period")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out/soak"))
    args = parser.parse_args(argv)
    args.seconds = args.seconds if args.seconds is not None else args.minutes * 60
    args.kills = [k for k in args.kills.split(",") if k]
    if set(args.kills) - set(KILLS) or args.seconds <= 0 or args.clients < 1:
        parser.error(f"need --kills of {', '.join(KILLS)}, a positive length, --clients >= 1")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (args.model or dummy_model(Path(tmp), args.arch, args.preset)).resolve()
        result = soak(args, model_dir, make_target(args, model_dir))
    return 0 if report(args, result) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
