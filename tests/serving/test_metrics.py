"""PublishedMetrics: callers never wait for a publish; counters add up, gauges keep their
latest value; a failed publish does not stop the next."""

from __future__ import annotations

import threading
import time

from orchestrator.serving.metrics import PublishedMetrics


class Recorded(PublishedMetrics):
    """Publishes into a list; the first publish waits for ``release`` (a slow IPC)."""

    def __init__(self, fail_first: bool = False) -> None:
        self.published: list[tuple[dict, dict]] = []
        self.release, self.fail_first = threading.Event(), fail_first
        self.publishing = threading.Event()
        super().__init__()

    def publish(self, added: dict, gauges: dict) -> None:
        self.publishing.set()
        self.release.wait(10)
        if self.fail_first and not self.published:
            self.published.append(({}, {}))
            raise RuntimeError("tritonserver said no")
        self.published.append((added, gauges))


def until(done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def totals(metrics: Recorded) -> tuple[dict, dict]:
    added: dict = {}
    gauges: dict = {}
    for a, g in metrics.published:
        for series, amount in a.items():
            added[series] = added.get(series, 0) + amount
        gauges.update(g)
    return added, gauges


def test_updates_made_during_a_slow_publish_are_coalesced_into_the_next():
    metrics = Recorded()
    metrics.queue_length(1)  # taken by the first publish, which then waits
    assert metrics.publishing.wait(5)
    started = time.monotonic()
    for outcome in ("finished", "finished", "cancelled"):
        metrics.request_done(outcome)
    metrics.kv_streamed(100, 0.5)
    metrics.kv_streamed(28, 0.25, ahead=20)
    metrics.held("prompts", 3)
    metrics.held("prompts", 0)
    metrics.queue_length(0)
    assert time.monotonic() - started < 0.5  # nobody waited for the publish in flight
    metrics.release.set()
    until(lambda: len(metrics.published) == 2)
    assert metrics.published[0] == ({}, {("queue_length", ""): 1})
    assert metrics.published[1] == (
        {("requests", "finished"): 2, ("requests", "cancelled"): 1,
         ("kv_bytes", ""): 128, ("kv_seconds", ""): 0.75, ("kv_ahead_bytes", ""): 20},
        {("held", "prompts"): 0, ("queue_length", ""): 0})


def test_a_failed_publish_does_not_stop_the_next():
    metrics = Recorded(fail_first=True)
    metrics.release.set()
    metrics.rerun("prompt")
    until(lambda: len(metrics.published) == 1)
    metrics.rerun("request")
    until(lambda: totals(metrics)[0] == {("reruns", "request"): 1})
