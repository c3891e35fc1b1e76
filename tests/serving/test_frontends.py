"""Two frontends on one cluster (``dejavu up --frontends 2``): both serve from the same P
and T pools, token-exact, and more streams than the T-nodes hold at once through both
finish (a T-node refuses a slot it does not have; the frontend goes to another pipeline).
One frontend killed with kill -9: a new request to the other is served at once, a stream
on the killed one ends with an error after tokens that are each the reference's, the
T-nodes free what the killed one held, the OpenAI API (in front of both) hands a request
for the killed one to the other, and the supervisor starts it again. Real tritonservers."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import (
    FAULT_TOKENS,
    FIXED,
    PROMPTS,
    Streaming,
    assert_all_freed,
    complete,
    ids_of,
    module_cluster,
    module_reference,
)

from clients.generate import stream_grpc
from orchestrator.cluster import chaos
from orchestrator.cluster.launcher import read_state, status_main
from orchestrator.cluster.tritonserver import alive, is_ready

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
# Each token pipeline holds 2 in its batch and 2 waiting (4 sequences); each frontend alone
# lets 8 in flight (both pipelines' sum), so two frontends' 24 streams overbook the slots.
BATCH, SLOTS = 2, 2

cluster = module_cluster("frontends", prefill=1, decode=2, frontends=2, max_batch=BATCH,
                         num_slots=SLOTS)
expected = module_reference(PROMPTS * 2, MAX_TOKENS)
long_expected = module_reference(PROMPTS[:1], FAULT_TOKENS, to_end=False)


def ids_on(url: str, prompts: list[str]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(
            lambda p: ids_of(list(stream_grpc(url, p, max_tokens=MAX_TOKENS))), prompts))


def test_status_lists_both_frontends_ready(cluster, capsys):
    assert status_main(["--json", "--dir", str(cluster.run_dir)]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert {n["name"]: n["ready"] for n in nodes if n["role"] == "frontend"} == {
        "frontend": True, "frontend1": True}


def test_both_frontends_serve_more_streams_than_the_slots_token_exact(cluster, expected):
    first, second = (s.grpc_url for s in cluster.frontends)
    prompts = PROMPTS * 2
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda url: ids_on(url, prompts), [first, second]))
    assert got == [expected, expected]
    assert_all_freed(cluster)  # no slot booked twice, none left behind


def test_one_frontend_killed_the_other_serves_a_new_request_at_once(cluster, expected,
                                                                   long_expected):
    survivor, victim = cluster.frontends
    texts = [complete(cluster, p, MAX_TOKENS, timeout_s=60)  # one on each frontend
             for p in PROMPTS[:2]]
    ongoing = Streaming(victim.grpc_url, PROMPTS[0], max_tokens=FAULT_TOKENS, **FIXED)
    ongoing.start()
    deadline = time.monotonic() + 60
    while len(ids_of(ongoing.chunks)) < 8:
        assert time.monotonic() < deadline and ongoing.is_alive(), "no tokens before the kill"
        time.sleep(0.05)
    killed_pid = next(n["pid"] for n in read_state(cluster.run_dir)["nodes"]
                      if n["name"] == victim.name)
    assert chaos.main(["kill", victim.name, "--dir", str(cluster.run_dir)]) == 0
    killed_at = time.monotonic()
    chunks = stream_grpc(survivor.grpc_url, PROMPTS[1], max_tokens=MAX_TOKENS)
    first = next(chunks)
    first_token_s = time.monotonic() - killed_at
    assert [*first.ids, *ids_of(chunks)] == expected[1]
    served_s = time.monotonic() - killed_at
    ongoing.join(60)
    assert not ongoing.is_alive()
    seen = ids_of(ongoing.chunks)
    print(f"\nthe survivor's new request: first token {first_token_s:.2f} s after the kill, "
          f"all {MAX_TOKENS} tokens {served_s:.2f} s; the killed frontend's stream: "
          f"{len(seen)} of {FAULT_TOKENS} tokens, then {ongoing.error!r}")
    # The killed frontend's client sees an error (tritonclient does not resend), and every
    # token it had was the reference's.
    assert ongoing.error is not None and seen == long_expected[0][:len(seen)]
    assert_all_freed(cluster)  # the T-nodes dropped the killed frontend's request
    # Four in turn: those that meet the killed frontend go to the other, no client error.
    victim_down = not is_ready(victim.http_url)
    assert [complete(cluster, p, MAX_TOKENS, timeout_s=60) for p in PROMPTS[:2] * 2] == texts * 2
    print(f"the OpenAI API's 4 completions in turn: served, the killed frontend "
          f"{'still down' if victim_down else 'back already'}")
    deadline = time.monotonic() + 300  # a tritonserver start, on cores others load too

    def restarted() -> bool:
        node = next(n for n in read_state(cluster.run_dir)["nodes"] if n["name"] == victim.name)
        return node["pid"] != killed_pid and alive(node["pid"]) and is_ready(victim.http_url)

    while not restarted():
        assert time.monotonic() < deadline, "the supervisor did not start the frontend again"
        time.sleep(0.2)
    assert ids_on(victim.grpc_url, PROMPTS) == expected[:len(PROMPTS)]
