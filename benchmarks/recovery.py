"""``dejavu bench recovery``: DejaVu Fig. 14 on a real cluster of tritonservers, and the
client-visible pause of a kill -9 of each role.

Five clusters (``Cluster``: controller, supervisor, P-nodes, one token pipeline
of depth D, the frontend), each with a warm-up and a batch of requests streamed
through the ensemble undisturbed, then its cases in turn: the same batch again
with the case's victim killed (kill -9 of its process group, as ``dejavu chaos
kill`` does) once every request has streamed ``--kill-at`` of its tokens, the
cluster whole again before the next case:

- ``spare`` (KV replicas, a warm spare, two P-nodes): the ``controller``, the
  ``frontend`` (its clients send their cut requests again, as any client of a
  restarted server must), a ``p-node`` (a second batch of new requests is sent
  at the kill: their time to first token, rerouted to the other P-node, against
  the undisturbed batch's), then a
  T-stage, ``t-stage+spare``, whose role the spare takes over;
- ``replicas`` (KV replicas, no spare): a T-stage (``t-stage``: the supervisor
  starts its tritonserver again, then the four recovery steps) and the head,
  ``stage0`` (the pipeline starts afresh, its requests run again);
- ``restart`` (``--replicate off``): a T-stage (``t-stage-no-replicas``): the
  requests run again from their prompts once the pipeline was started afresh;
- ``frontends`` (two frontends, ``--frontends 2``): the second one,
  ``frontend-of-two``: the batch streams through it, a second batch of new requests is
  sent to the first at the kill (their time to first token against the undisturbed
  batch's); the cut streams end with an error (tritonclient does not resend) and are not
  sent again, so the new requests meet only the loss, not twice the load;
- ``head-spare`` (KV replicas, a warm spare, one P-node and a warm P spare): the lone
  P-node, ``p-node+spare`` (as ``p-node``, a batch of new requests sent at the kill:
  the P spare takes its role and prefills them), then the head, ``stage0+spare``: the
  spare takes stage 0's role, the surviving stage is wired to it, and the requests run
  again from their prompts on the same pipeline.

``client_pause_s`` is the longest a client waited between two chunks, against
``normal_pause_s`` undisturbed; ``ratio`` the failed batch's latency over the
undisturbed one's (Fig. 14's). A poller asks the controller every few ms when
the victim was declared dead (``detect_s``) and when its pipeline serves again
(``repair_s``). Every request's tokens, in every run, are checked against the
single-process reference.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clients.common import PROMPTS, dummy_model, model_arguments, reference, write_csv
from clients.provenance import provenance

# Each cluster's settings, and the kills made on it in turn (the cluster whole again between
# two): the spare's takeover last, as the new spare it starts loads for minutes here.
CLUSTERS = {
    "spare": ({"replicate": "on", "spares": 1, "prefill": 2},
              ["controller", "frontend", "p-node", "t-stage+spare"]),
    "replicas": ({"replicate": "on", "spares": 0}, ["t-stage", "stage0"]),
    "restart": ({"replicate": "off", "spares": 0}, ["t-stage-no-replicas"]),
    "frontends": ({"replicate": "on", "spares": 0, "frontends": 2}, ["frontend-of-two"]),
    "head-spare": ({"replicate": "on", "spares": 1, "prefill_spares": 1},
                   ["p-node+spare", "stage0+spare"]),
}
VICTIMS = {"controller": "controller", "frontend": "frontend", "p-node": "prefill0",
           "t-stage+spare": "decode0s{stage}", "t-stage": "decode0s{stage}",
           "stage0": "decode0s0", "t-stage-no-replicas": "decode0s{stage}",
           "frontend-of-two": "frontend1", "stage0+spare": "decode0s0",
           "p-node+spare": "prefill0"}
NEW_REQUESTS = ("p-node", "p-node+spare", "frontend-of-two")  # a batch sent at the kill
RESENT = ("frontend",)  # its cut streams are sent again (from their prompts)
CUT = ("frontend-of-two",)  # its cut streams end with an error, the tokens before it exact
CASES = [case for _, cases in CLUSTERS.values() for case in cases]
PAPER = {"t-stage+spare": 1.24, "t-stage": 1.24, "t-stage-no-replicas": 1.91}  # OPT-66B


class Stream(threading.Thread):
    """One request streamed through the ensemble: its tokens and when each chunk came.
    ``retry``: a stream cut (its frontend was killed) is sent again from its prompt, as any
    client of a restarted server must, until ``retry_s`` after the cut; the tokens are the
    last try's."""

    def __init__(self, url: str, prompt: str, max_tokens: int, retry: bool = False,
                 retry_s: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.retry, self.retry_s = retry, retry_s
        self.ids: list[int] = []
        self.times: list[float] = []
        self.started = self.ended = 0.0
        self.error: str | None = None

    def run(self) -> None:
        from tritonclient.utils import InferenceServerException

        from clients.generate import GenerateError, stream_grpc

        self.started = time.monotonic()
        cut_at: float | None = None
        while True:
            try:
                # end_id -1: a fixed length, as the reference's (no end token)
                for chunk in stream_grpc(self.url, self.prompt, max_tokens=self.max_tokens,
                                         end_id=-1):
                    self.ids.extend(chunk.ids)
                    self.times.append(time.monotonic())
                self.error = None
                break
            except (GenerateError, InferenceServerException) as exc:  # cut, or refused
                self.error = str(exc)
                cut_at = cut_at or time.monotonic()
                if not self.retry or time.monotonic() - cut_at > self.retry_s:
                    break
                self.ids = []  # the next try streams from the first token
                time.sleep(0.05)
        self.ended = time.monotonic()

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] - self.started if self.times else None


@dataclass
class Batch:
    latency_s: float
    outputs: list[list[int]]
    errors: list[str]
    pause_s: float  # the longest a client waited between two chunks
    ttft_s: float  # the longest wait for a first token


def run_batch(url: str, prompts: list[str], max_tokens: int,
              when_halfway: tuple[int, Callable[[], None]] | None = None,
              timeout_s: float = 300.0, retry: bool = False) -> Batch:
    """Stream every prompt at once; ``when_halfway``: (tokens, action) runs the action once
    every request has streamed that many tokens."""
    streams = [Stream(url, p, max_tokens, retry) for p in prompts]
    for s in streams:
        s.start()
    if when_halfway is not None:
        tokens, action = when_halfway
        deadline = time.monotonic() + timeout_s
        while min(len(s.ids) for s in streams) < tokens:
            if time.monotonic() > deadline or not any(s.is_alive() for s in streams):
                raise RuntimeError(f"the requests never reached {tokens} tokens")
            time.sleep(0.005)
        action()
    for s in streams:
        s.join(timeout_s)
        if s.is_alive():
            raise RuntimeError(f"a request did not finish within {timeout_s:.0f} s")
    gaps = [b - a for s in streams for a, b in zip([s.started, *s.times], s.times, strict=False)]
    return Batch(max(s.ended for s in streams) - min(s.started for s in streams),
                 [s.ids for s in streams], [s.error for s in streams if s.error],
                 max(gaps, default=0.0), max((s.ttft_s or 0.0) for s in streams))


@dataclass
class Watch:
    """When the controller declared the victim dead and the pipeline served again."""

    controller: str
    secret: bytes  # the cluster's (every controller call is signed)
    victim: str  # its controller node id
    pipeline: str
    dead_at: float | None = None
    serving_at: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, poll_s: float = 0.005) -> None:
        from orchestrator.fault.client import query_status

        while not self.stop.wait(poll_s):
            try:
                view = query_status(self.controller, self.secret, timeout_s=1.0)
            except Exception:  # noqa: BLE001  (busy: ask again)
                continue
            now = time.monotonic()
            if self.dead_at is None and any(n["node_id"] == self.victim and not n["alive"]
                                            for n in view["nodes"]):
                self.dead_at = now
            if self.dead_at is not None and view["pipelines"][self.pipeline]["state"] == \
                    "serving":
                self.serving_at = now
                return


def bench_cluster(args, name: str, model: Path, expected: list[list[int]], run_dir: Path
                  ) -> list[dict]:
    """One cluster, its cases one after another: a row each."""
    from benchmarks.soak import wait_whole
    from orchestrator.cluster.launcher import Cluster
    from orchestrator.cluster.pid_watch import watching

    settings, cases = CLUSTERS[name]
    cases = [c for c in cases if c in args.cases]
    if not cases:
        return []
    print(f"{name}: starting the cluster", flush=True)
    rows = []
    settings = {"prefill": 1, **settings}
    with Cluster.up(model, decode=1, decode_depth=args.depth, run_dir=run_dir,
                    max_batch=args.batch, max_seq_len=args.max_seq_len,
                    dead_after_s=args.timeout_s, controller_timeout_s=args.timeout_s,
                    **settings) as cluster:
        url = cluster.frontend.grpc_url
        run_batch(url, expected_prompts(args.batch), args.tokens)  # warm-up: every process ran
        free = run_batch(url, expected_prompts(args.batch), args.tokens)
        for case in cases:
            if not (wait_whole(run_dir, 300) and _until(lambda: watching(run_dir), 120)):
                raise RuntimeError(f"{name}: the cluster was not whole before {case}")
            rows.append(bench_case(args, case, url, free, expected, run_dir))
    return rows


def bench_case(args, case: str, url: str, free: Batch, expected: list[list[int]],
               run_dir: Path) -> dict:
    """Kill the case's victim once every request of a batch is halfway."""
    from orchestrator.cluster.chaos import kill, targets
    from orchestrator.cluster.launcher import read_state
    from orchestrator.control.auth import load_secret

    prompts = expected_prompts(args.batch)
    state = read_state(run_dir)
    victim = targets(state, run_dir)[VICTIMS[case].format(stage=args.kill_stage)]
    # A node the controller watches: when it was declared dead, when its pipeline serves.
    node = victim["config"] if victim.get("role") in ("decode", "prefill") else {}
    watch = Watch(state["controller"]["address"], load_secret(state["secret_file"]),
                  node.get("name", ""), f"{node.get('role', 'decode')}{node.get('pipeline', 0)}")
    watcher = threading.Thread(target=watch.run, daemon=True)
    if node:  # a node the controller watches
        watcher.start()
    killed_at = 0.0
    during: list[Batch] = []  # NEW_REQUESTS: a batch sent at the kill
    # frontend-of-two: the batch streams through the victim, new requests go to the other
    survivor, url = (url, state["frontends"][1]["grpc"]) if case == "frontend-of-two" else (
        url, url)

    def kill_victim() -> None:
        nonlocal killed_at
        killed_at = time.monotonic()
        kill(victim, signal.SIGKILL)
        if case in NEW_REQUESTS:
            during.append(run_batch(survivor, prompts, args.tokens))

    failed = run_batch(url, prompts, args.tokens, (args.kill_at, kill_victim),
                       retry=case in RESENT)
    if node:
        watcher.join(args.timeout_s + 300)
    watch.stop.set()
    outputs = [free.outputs, *(b.outputs for b in during)]
    cut_exact = all(o == e[:len(o)] for o, e in zip(failed.outputs, expected, strict=True))
    if case not in CUT:
        outputs.append(failed.outputs)
    errors = (free.errors + (failed.errors if case not in CUT else [])
              + [e for b in during for e in b.errors])
    row = {
        "case": case,
        "killed": victim["name"],
        "undisturbed_s": round(free.latency_s, 3),
        "failed_s": round(failed.latency_s, 3),
        # frontend-of-two: the cut streams end at the kill; no batch to compare
        "ratio": round(failed.latency_s / free.latency_s, 3) if case not in CUT else None,
        "detect_s": _since(killed_at, watch.dead_at),
        "repair_s": _since(watch.dead_at, watch.serving_at),
        "client_pause_s": round(failed.pause_s, 3),
        "normal_pause_s": round(free.pause_s, 3),
        "ttft_normal_s": round(free.ttft_s, 3),
        "ttft_new_requests_s": round(during[0].ttft_s, 3) if during else None,
        "token_exact": all(o == expected for o in outputs) and cut_exact,
        "errors": len(errors) if case not in RESENT else len(free.errors) + sum(
            len(b.errors) for b in during),
        "paper": PAPER.get(case),
    }
    print(f"{case}: {row}", flush=True)
    if not row["token_exact"] or row["errors"]:
        print(f"{case}: errors {errors}", flush=True)
    return row


def _until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 3)


def expected_prompts(batch: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]


def write_outputs(out: Path, rows: list[dict], args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "recovery.csv", rows)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (out / "recovery.json").write_text(json.dumps({"settings": settings, "rows": rows,
                                                   **provenance()},
                                                  indent=2) + "\n")


def print_table(rows: list[dict], args) -> None:
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    print(f"failed batch = {args.batch} requests x {args.tokens} tokens, the victim "
          f"(t-stage: stage {args.kill_stage} of {args.depth}) killed after {args.kill_at} "
          f"tokens; heartbeat timeout {args.timeout_s} s (detect_s: kill -> declared dead; "
          f"client_pause_s: the longest wait between two chunks; {', '.join(NEW_REQUESTS)}: "
          f"ttft of new requests sent at the kill, to the other frontend for the last); "
          f"paper (OPT-66B): {PAPER['t-stage']}x with replicas, "
          f"{PAPER['t-stage-no-replicas']}x restart")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench recovery",
                                     description=__doc__.splitlines()[0])
    model_arguments(parser, "llama", "small")
    parser.add_argument("--depth", type=int, default=2, help="T-stages of the pipeline")
    parser.add_argument("--batch", type=int, default=4, help="requests in the batch")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per request")
    parser.add_argument("--kill-at", type=int, help="kill once every request streamed this "
                        "many tokens (default: half)")
    parser.add_argument("--kill-stage", type=int, default=1, help="the stage killed (>= 1)")
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="heartbeat timeout of the controller and the head")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=Path("bench_out/recovery"),
                        help="results; runs/<cluster>: each cluster's folder and logs")
    parser.add_argument("--quick", action="store_true", help="tiny model, short run (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.tokens, args.batch = "tiny", 48, 2
    args.kill_at = args.kill_at or args.tokens // 2
    args.max_seq_len = 256
    args.cases = args.cases.split(",")
    if (args.depth < 2 or not 1 <= args.kill_stage < args.depth
            or not 0 < args.kill_at < args.tokens or set(args.cases) - set(CASES)):
        parser.error(f"need --depth >= 2, 1 <= --kill-stage < depth, 0 < --kill-at < "
                     f"--tokens, --cases of {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        args.model = args.model or dummy_model(Path(tmp), args.arch, args.preset)
        expected = reference(args.model, expected_prompts(args.batch), args.tokens,
                             args.max_seq_len)
        rows = [row for name in CLUSTERS  # each cluster's logs stay in runs/<name>
                for row in bench_cluster(args, name, args.model, expected,
                                         args.out / "runs" / name)]
    print_table(rows, args)
    write_outputs(args.out, rows, args)
    print(f"wrote {args.out}/recovery.csv and recovery.json")
    return 0 if all(r["token_exact"] and not r["errors"] for r in rows) else 1

