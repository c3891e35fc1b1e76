"""Replacing a lost T-stage of a token pipeline whose stages are processes (Triton T-nodes).

Two halves, as in DejaVu §4.3:

- :class:`RecoveryOps`, on every T-node: the node's part of each step, as
  control operations (bytes in, bytes out) that the node's service answers;
- :func:`recover_stage`, on whoever coordinates (the cluster supervisor): once
  the controller has a plan (a replacement registered in every lost slot), it
  calls each node's operations in order through ``call(url, op, args)``.

The order, for lost stages X; the calls of a row go out together, and the two rows
marked ``||`` with each other::

    head: pause; every survivor: quiet  ||    nothing moves (steps to a lost stage died)
    everyone: endpoints, replica_endpoints;
    new x: connect, replicate           ||    its ring and replicas point at its neighbours
    head: rewind(resume); x-1: reconnect      step 3: microbatch j redoes from step t; ring
    (a new head: every survivor follow_head)  and replicas now go to the new x
    x+1: restore -> new x: adopt              step 1: x's KV from the replica x+1 held
    survivors: rollback                       step 4 (and the replicas held are dropped)
    everyone: reseed; new x: start            step 2 (x-1 re-sends x's replicas)
    everyone: recovered
    head: resume

:func:`repair_links` is the same without a lost stage: a dropped connection
(``drop_link`` is its drill) made a stage report that it cannot send on.

A lost stage 0 took its head with it: its replacement's head starts empty. Each
request keeps the KV length every survivor holds and stage 1's replica of stage 0
holds (``sequences``); stage 0's part is restored into the replacement as any lost
stage's, and the new head is told which requests it may take back
(``reattachable``): the frontend re-attaches each with the tokens it has delivered,
and the pipeline computes on from the KV kept (a request not kept runs again from
its prompt).

When the plan says ``recompute`` (a lost stage's replica holder is lost too),
every microbatch redoes from step 0: the head ends its running requests with
an error saying their prompt KV was lost, and the frontend runs them again
from the prompt (the log says so). Requests whose prompt KV was still on its
way to a lost stage fail their KV probe the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict

from orchestrator.engine.sampling import SamplingParams
from orchestrator.fault.client import ControllerClient
from orchestrator.fault.disk_replication import DiskReplication
from orchestrator.fault.node_replication import NodeReplication
from orchestrator.pipeline.node import StageNode

log = logging.getLogger("dejavu.fault.recovery")

Call = Callable[[str, str, list[bytes]], bytes]  # (node url, op, args) -> reply
QUIET_POLL_S = 0.005  # the head is paused while the stages settle: ask often


class RecoveryOps:
    """A T-node's replication and recovery operations, answered as control requests."""

    def __init__(self, node: StageNode, replication: NodeReplication | DiskReplication,
                 controller: ControllerClient | None = None) -> None:
        self.node, self.replication, self.controller = node, replication, controller

    def ops(self) -> dict[str, Callable[..., bytes | None]]:
        """Each operation by name; its arguments are the request's ``peers``."""
        replication = self.replication
        return {
            "replica_endpoints": replication.endpoints, "replicate": replication.connect,
            "reconnect": self._reconnect, "follow_head": self.node.follow_head,
            "sequences": self._sequences, "reattachable": self._reattachable,
            "pause": self._pause, "quiet": self._quiet,
            "rewind": self._rewind, "restore": self._restore, "adopt": self._adopt,
            "rollback": self._rollback, "reseed": replication.reseed,
            "recovered": self._recovered, "resume": self._resume, "fault": self._fault,
            "give_up": self._give_up, "drop_link": self.node.drop_link,
        }

    def _head(self):  # noqa: ANN202  (a PipelineHead; only node 0 has one)
        if self.node.head is None:
            raise ValueError(f"stage {self.node.index} holds no head (stage 0 does)")
        return self.node.head

    def _reconnect(self, ring: bytes, replication: bytes) -> None:
        self.node.reconnect(ring)
        self.replication.reconnect(replication)

    def _pause(self) -> None:
        self._head().pause()

    def _quiet(self) -> bytes:
        return b"1" if self.node.quiet() else b"0"

    def _rewind(self, resume: bytes) -> bytes:
        """``resume``: JSON {microbatch: step}, or ``answered``: each microbatch's first
        step the head has no answer for (a connection dropped: no stage, no KV was lost)."""
        head = self._head()
        lost = resume != b"answered"
        steps = ({int(j): int(t) for j, t in json.loads(resume).items()} if lost
                 else dict.fromkeys(range(head.num_microbatches), 1 << 62))
        lengths = head.rewind(steps, prompt_kv_lost=lost)
        # The redo's samplers resume after the tokens kept (penalties, min_tokens read them).
        sampling = {s.seq_id: asdict(s.sampling.resumed(s.output_ids)) for s in head.running()
                    if s.seq_id in lengths}
        return json.dumps({"lengths": lengths, "sampling": sampling}).encode()

    def _sequences(self) -> bytes:
        """What a survivor holds of each request: its KV (``kv``: seq id -> [request id,
        length]) and the replicas of its predecessor (``replicas``: seq id -> length)."""
        return json.dumps({"kv": self.node.sequences(),
                           "replicas": self.replication.replica_lengths()}).encode()

    def _reattachable(self, kept: bytes) -> None:
        self._head().expect_reattach({r: (int(s), int(n)) for r, (s, n)
                                      in json.loads(kept).items()})

    def _restore(self, to: bytes, lengths: bytes) -> None:
        self.replication.restore(to, {str(s): n for s, n in json.loads(lengths).items()})

    def _adopt(self, lengths: bytes, sampling: bytes) -> None:
        self.replication.adopt(
            {str(s): n for s, n in json.loads(lengths).items()},
            {int(s): SamplingParams(**p) for s, p in json.loads(sampling).items()})

    def _rollback(self, lengths: bytes) -> None:
        self.replication.rollback({int(s): n for s, n in json.loads(lengths).items()})

    def _recovered(self, epoch: bytes) -> None:
        if self.controller is not None:
            self.controller.recovered(int(epoch))

    def _fault(self) -> bytes:
        """The head's: why it is paused waiting for a repair (empty: it is not)."""
        return (self._head().fault or "").encode()

    def _give_up(self, error: bytes) -> None:
        self._head().give_up(error.decode(errors="replace"))

    def _resume(self) -> None:
        self.node.repaired()
        self._head().resume()


def recover_stage(call: Call, urls: list[str], plan: dict, quiet_timeout_s: float = 30.0
                  ) -> dict[str, int]:
    """Carry out the controller's ``plan`` on a pipeline whose stages are at ``urls`` (stage
    0 first; a replacement's url in each lost slot); returns the KV length each running
    request kept (the others start over). Raises on any failed call (the head then breaks
    at its ``recover_timeout_s``). Calls that do not depend on each other go out together."""
    failed, depth = [int(x) for x in plan["failed"]], len(urls)
    survivors = [i for i in range(depth) if i not in failed]
    recompute = bool(plan["recompute"])
    resume = {} if recompute else dict(plan["resume"])  # a microbatch not named: step 0
    if recompute:
        log.warning("stages %s and their replica holders are lost: recomputing, every "
                    "running request starts over from its prompt", failed)

    with _Calls(call, depth) as calls:
        began = time.monotonic()

        def wire() -> tuple[dict[int, bytes], dict[int, bytes], float]:
            """Every stage's endpoints, and each replacement wired to its neighbours (not
            started: nothing reaches it yet), while the survivors settle."""
            ring, replicas = _endpoints(calls, urls)
            calls.each([(urls[x], "connect", [ring[(x + 1) % depth], ring[0]])
                        for x in failed])
            calls.each([(urls[x], "replicate", [replicas[(x + 1) % depth],
                                                replicas[(x - 1) % depth]]) for x in failed])
            return ring, replicas, time.monotonic()

        wired = calls.pool.submit(wire)
        _settle(calls, urls, survivors, quiet_timeout_s)
        quiet = time.monotonic()
        ring, replicas, wired_at = wired.result()
        settled = time.monotonic()
        # Once settled: the predecessors' rings and replicas go to the replacements.
        reconnects = [(urls[(x - 1) % depth], "reconnect", [ring[x], replicas[x]])
                      for x in failed if (x - 1) % depth not in failed]
        rewound, *_ = calls.each([(urls[0], "rewind", [json.dumps(resume).encode()]),
                                  *reconnects])
        rewound = json.loads(rewound)
        kept: dict[str, tuple[int, int]] = {}  # a lost head's: request -> (seq id, length)
        if 0 in failed:  # the survivors' heartbeats go to the new head
            replies = calls.each([*((urls[i], "follow_head", [ring[0]]) for i in survivors),
                                  *((urls[i], "sequences", []) for i in survivors)])
            if not recompute:
                kept = _kept_of_lost_head([json.loads(r) for r in replies[len(survivors):]])
                rewound["lengths"] = {str(s): n for s, n in kept.values()}
        lengths = json.dumps(rewound["lengths"]).encode()
        rewound_at = time.monotonic()
        sampling = json.dumps(rewound["sampling"]).encode()

        def restore(holder: int, x: int) -> None:  # step 1: x's KV back from its holder
            call(urls[holder], "restore", [replicas[x], lengths])
            call(urls[x], "adopt", [lengths, sampling])

        for future in [calls.pool.submit(restore, holder, x)
                       for holder, x in ([] if recompute else plan["restore"])]:
            future.result()
        if kept:
            calls.one(urls[0], "reattachable", [json.dumps(kept).encode()])
        restored = time.monotonic()
        _resume(calls, urls, survivors, lengths, failed, plan["epoch"])
        done = time.monotonic()
    log.warning("stages %s recovered: %s in %.2f s (settling %.2f s: quiet after %.2f s, "
                "replacements wired after %.2f s; rewinding %.2f s, restoring KV %.2f s, "
                "resuming %.2f s)", failed, "recomputed from prompts" if recompute
                else f"resumed at {resume} with {len(rewound['lengths'])} requests kept",
                done - began, settled - began, quiet - began, wired_at - began,
                rewound_at - settled, restored - rewound_at, done - restored)
    return rewound["lengths"]


def _kept_of_lost_head(survivors: list[dict]) -> dict[str, tuple[int, int]]:
    """Each request whose KV every survivor (stage 1 first) holds and whose stage 0 KV
    stage 1's replica holds: request id -> (seq id, the length all of them hold)."""
    kept: dict[str, tuple[int, int]] = {}
    for seq, (request, length) in survivors[0]["kv"].items():
        held = [length, survivors[0]["replicas"].get(seq, 0),
                *(s["kv"].get(seq, ("", 0))[1] for s in survivors[1:])]
        if min(held) > 0:
            kept[request] = (int(seq), min(held))
    return kept


def repair_links(call: Call, urls: list[str], quiet_timeout_s: float = 30.0) -> int:
    """Every stage alive, but a connection between two dropped (the head paused on a
    stage's report): every stage connects to its successor again, and each microbatch
    redoes its first step the head has no answer for (the step lost on the way). Returns
    how many running requests were kept."""
    depth = len(urls)
    survivors = list(range(depth))
    with _Calls(call, depth) as calls:
        endpoints = calls.pool.submit(_endpoints, calls, urls)
        _settle(calls, urls, survivors, quiet_timeout_s)
        ring, replicas = endpoints.result()
        calls.each([(url, "reconnect", [ring[(i + 1) % depth], replicas[(i + 1) % depth]])
                    for i, url in enumerate(urls)])
        rewound = json.loads(calls.one(urls[0], "rewind", [b"answered"]))
        _resume(calls, urls, survivors, json.dumps(rewound["lengths"]).encode(), [])
    log.warning("pipeline %s: connections restored, %d requests kept", urls[0],
                len(rewound["lengths"]))
    return len(rewound["lengths"])


class _Calls:
    """``call`` one at a time, or a round of independent calls at once (one thread each)."""

    def __init__(self, call: Call, threads: int) -> None:
        self.one = call
        # a round of every stage's two endpoints, beside the caller's and a round's own
        self.pool = ThreadPoolExecutor(2 * threads + 2, thread_name_prefix="recovery")

    def each(self, calls: list[tuple[str, str, list[bytes]]]) -> list[bytes]:
        """Every call's reply, in order; the first failure raises once all have ended."""
        futures = [self.pool.submit(self.one, *c) for c in calls]
        wait(futures)
        return [f.result() for f in futures]

    def __enter__(self) -> _Calls:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)


def _endpoints(calls: _Calls, urls: list[str]) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """Every stage's ring and replica endpoints (fixed for a node's life)."""
    replies = calls.each([(url, op, []) for op in ("endpoints", "replica_endpoints")
                          for url in urls])
    return dict(enumerate(replies[: len(urls)])), dict(enumerate(replies[len(urls):]))


def _settle(calls: _Calls, urls: list[str], survivors: list[int], timeout_s: float) -> None:
    """Pause the head and wait until nothing moves (a step sent to a lost stage or over a
    lost connection is gone): each survivor, upstream first (what a stage passes on has
    reached the next), has handled what it took and has nothing in its inbox."""
    calls.one(urls[0], "pause", [])
    for i in survivors:
        deadline = time.monotonic() + timeout_s
        while calls.one(urls[i], "quiet", []) != b"1":
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {i} ({urls[i]}) still busy {timeout_s} s after "
                                   "the pause")
            time.sleep(QUIET_POLL_S)


def _resume(calls: _Calls, urls: list[str], survivors: list[int], lengths: bytes,
            new: list[int], epoch: int | None = None) -> None:
    """The order's last two rows (module docstring), a round each: every survivor's rollback
    drops the replicas it holds before any reseed sends new ones. With ``epoch``, every
    node closes the controller's plan (its acks start over from the rollback)."""
    calls.each([(urls[i], "rollback", [lengths]) for i in survivors])
    calls.each([*((url, "reseed", []) for url in urls), *((urls[x], "start", []) for x in new)])
    if epoch is not None:
        calls.each([(url, "recovered", [str(epoch).encode()]) for url in urls])
    calls.one(urls[0], "resume", [])
