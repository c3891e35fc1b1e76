"""``dejavu bench recovery``: DejaVu Fig. 14 on a real cluster of tritonservers.

One cluster per mode (``Cluster``: controller, supervisor, a P-node, one token
pipeline of depth D, the frontend), each run alike: a warm-up, then a batch of
requests streamed through the ensemble undisturbed, then the same batch with a
T-stage killed (kill -9 of its process group, as ``dejavu chaos kill`` does)
once every request has streamed ``--kill-at`` of its tokens. The failed batch's
latency over the undisturbed one's, in the same cluster, is Fig. 14's ratio:

- ``spare``: KV replicas and a warm spare, which takes over the lost stage;
- ``replicas``: KV replicas, no spare: the supervisor starts the lost
  tritonserver again (its model loads again), then the same four steps;
- ``restart``: no replicas (``--replicate off``): the requests run again
  from their prompts once the pipeline was started afresh.

A poller asks the controller every few ms when the lost node was declared
dead (``detect_s``: heartbeat timeout, or sooner when a stage's transport lost
its connection to it and the controller found its address closed) and when
the pipeline serves again (``repair_s``). Every request's tokens, in every
run, are checked against the single-process reference.
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

MODES = {
    "spare": {"replicate": "on", "spares": 1},
    "replicas": {"replicate": "on", "spares": 0},
    "restart": {"replicate": "off", "spares": 0},
}
PAPER = {"spare": 1.24, "replicas": 1.24, "restart": 1.91}  # OPT-66B, Fig. 14


class Stream(threading.Thread):
    """One request streamed through the ensemble: its tokens and when each chunk came."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.ids: list[int] = []
        self.times: list[float] = []
        self.started = self.ended = 0.0
        self.error: str | None = None

    def run(self) -> None:
        from clients.generate import GenerateError, stream_grpc

        self.started = time.monotonic()
        try:
            for chunk in stream_grpc(self.url, self.prompt, max_tokens=self.max_tokens):
                self.ids.extend(chunk.ids)
                self.times.append(time.monotonic())
        except GenerateError as exc:
            self.error = str(exc)
        self.ended = time.monotonic()


@dataclass
class Batch:
    latency_s: float
    outputs: list[list[int]]
    errors: list[str]
    pause_s: float  # the longest a client waited between two chunks


def run_batch(url: str, prompts: list[str], max_tokens: int,
              when_halfway: tuple[int, Callable[[], None]] | None = None,
              timeout_s: float = 300.0) -> Batch:
    """Stream every prompt at once; ``when_halfway``: (tokens, action) runs the action once
    every request has streamed that many tokens."""
    streams = [Stream(url, p, max_tokens) for p in prompts]
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
                 max(gaps, default=0.0))


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


def bench_mode(args, mode: str, model: Path, expected: list[list[int]], run_dir: Path
               ) -> dict:
    from orchestrator.cluster.chaos import kill, targets
    from orchestrator.cluster.launcher import Cluster, read_state
    from orchestrator.control.auth import load_secret

    prompts = expected_prompts(args.batch)
    print(f"{mode}: starting the cluster", flush=True)
    with Cluster.up(model, prefill=1, decode=1, decode_depth=args.depth, run_dir=run_dir,
                    max_batch=args.batch, max_seq_len=args.max_seq_len,
                    dead_after_s=args.timeout_s, controller_timeout_s=args.timeout_s,
                    **MODES[mode]) as cluster:
        url = cluster.frontend.grpc_url
        run_batch(url, prompts, args.tokens)  # warm-up: every process has run a step
        free = run_batch(url, prompts, args.tokens)
        victim_name = f"decode0s{args.kill_stage}"
        victim = targets(read_state(run_dir), run_dir)[victim_name]
        state = read_state(run_dir)
        watch = Watch(cluster.controller.address, load_secret(state["secret_file"]),
                      victim["config"]["name"], "decode0")
        watcher = threading.Thread(target=watch.run, daemon=True)
        watcher.start()
        killed_at = 0.0

        def kill_victim() -> None:
            nonlocal killed_at
            killed_at = time.monotonic()
            kill(victim, signal.SIGKILL)

        failed = run_batch(url, prompts, args.tokens, (args.kill_at, kill_victim))
        watcher.join(args.timeout_s + 300)
        watch.stop.set()
    exact = free.outputs == expected and failed.outputs == expected
    row = {
        "mode": mode,
        "undisturbed_s": round(free.latency_s, 3),
        "failed_s": round(failed.latency_s, 3),
        "ratio": round(failed.latency_s / free.latency_s, 3),
        "detect_s": _since(killed_at, watch.dead_at),
        "repair_s": _since(watch.dead_at, watch.serving_at),
        "client_pause_s": round(failed.pause_s, 3),
        "token_exact": exact,
        "errors": len(free.errors) + len(failed.errors),
        "paper": PAPER[mode],
    }
    print(f"{mode}: {row}", flush=True)
    if not exact or row["errors"]:
        print(f"{mode}: errors {free.errors + failed.errors}", flush=True)
    return row


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
    print(f"failed batch = {args.batch} requests x {args.tokens} tokens, stage "
          f"{args.kill_stage} of {args.depth} killed after {args.kill_at} tokens; detection "
          f"timeout {args.timeout_s} s (detect_s: kill -> declared dead); paper (OPT-66B): "
          f"{PAPER['replicas']}x with replicas, {PAPER['restart']}x restart")


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
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=Path("bench_out/recovery"),
                        help="results; runs/<mode>: each cluster's folder and logs")
    parser.add_argument("--quick", action="store_true", help="tiny model, short run (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.tokens, args.batch = "tiny", 48, 2
    args.kill_at = args.kill_at or args.tokens // 2
    args.max_seq_len = 256
    modes = args.modes.split(",")
    if (args.depth < 2 or not 1 <= args.kill_stage < args.depth
            or not 0 < args.kill_at < args.tokens or set(modes) - set(MODES)):
        parser.error(f"need --depth >= 2, 1 <= --kill-stage < depth, 0 < --kill-at < "
                     f"--tokens, --modes of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        args.model = args.model or dummy_model(Path(tmp), args.arch, args.preset)
        expected = reference(args.model, expected_prompts(args.batch), args.tokens,
                             args.max_seq_len)
        rows = [bench_mode(args, mode, args.model, expected, args.out / "runs" / mode)
                for mode in modes]  # each cluster's logs stay there
    print_table(rows, args)
    write_outputs(args.out, rows, args)
    print(f"wrote {args.out}/recovery.csv and recovery.json")
    return 0 if all(r["token_exact"] and not r["errors"] for r in rows) else 1

