"""Join-the-shortest-queue by pending tokens, and nodes marked down."""

import pytest

from orchestrator.serving.router import NoNodeError, Router


def test_picks_the_node_with_fewest_pending_tokens():
    router = Router(["a", "b", "c"])
    assert router.pick(100) == "a"
    assert router.pick(10) == "b"
    assert router.pick(10) == "c"
    assert router.pick(5) == "b"  # b: 10, c: 10 -> b first; then b: 15
    router.done("a", 100)
    assert router.pick(1) == "a"


def test_assign_returns_tokens_on_exit_even_on_error():
    router = Router(["a", "b"])
    with pytest.raises(RuntimeError), router.assign(50) as node:
        assert node == "a"
        raise RuntimeError("boom")
    assert router.pending == {"a": 0, "b": 0}


def test_down_node_is_skipped_until_its_time_is_up():
    router = Router(["a", "b"], down_s=60)
    router.mark_down("a")
    assert [router.pick(1) for _ in range(3)] == ["b", "b", "b"]
    router.mark_down("b")
    with pytest.raises(NoNodeError, match="all nodes down"):
        router.pick(1)
    router.down_s = 0
    router.mark_down("a")
    assert router.pick(1) == "a"


def test_check_live_fails_only_when_every_node_is_down():
    # The frontend asks before it takes a T slot for a prompt no P-node could write.
    router = Router(["a", "b"], down_s=60)
    router.mark_down("a")
    router.check_live()
    router.mark_down("b")
    with pytest.raises(NoNodeError, match="all nodes down"):
        router.check_live()


def test_a_node_marked_up_while_down_counts_as_a_revival():
    """A request waiting to run again goes as soon as a lost node is back (the frontend
    watches this count), not after the rest of its backoff."""
    router = Router(["a", "b"])
    router.mark_up("a")  # never down: nothing came back
    assert router.revivals == 0
    router.mark_down("a")
    router.mark_up("a")
    router.mark_up("a")
    assert router.revivals == 1


def test_a_full_node_is_passed_over_while_another_has_room():
    """A request routed to a node with no free slot only waits there, holding its seat: the
    router takes the other while it has room, and the full one again once it frees."""
    router = Router(["a", "b"], slots={"a": 2, "b": 2})
    assert [router.pick(1) for _ in range(2)] == ["a", "b"]
    router.done("a", 1)
    assert router.pick(100) == "a"  # fewest pending; now holds its 2
    assert router.pick(1) == "b"  # a is full although b has more pending
    assert router.pick(1) == "b"  # every node full: fewest pending (a 100, b 2)
    router.leave("a")
    assert router.pick(1) == "a"
    with router.assign(5) as node:  # both full: fewest pending
        assert (node, router.held["b"]) == ("b", 4)
    assert router.held == {"a": 2, "b": 3} and router.pending["b"] == 3


# -- KV-aware and round-robin ------------------------------------------------------------


def kv_router(**kwargs) -> Router:
    return Router(["a", "b"], policy="kv", block_tokens=4, **kwargs)


def test_kv_routes_a_prompt_to_the_node_holding_its_prefix_unless_it_is_far_busier():
    router = kv_router()
    router.kv_events("b", {"cursor": "e:1", "events": [["stored", [1, 2, 3]]]})
    assert router.kv_cursor("b") == "e:1"
    with router.assign(16, [1, 2, 3, 4]) as node:  # b: 12 tokens cached, 4 to compute
        assert node == "b" and router.pending["b"] == 4
    assert router.pending == {"a": 0, "b": 0}
    router.pending["b"] = 60  # b's queue outweighs the 12 tokens it would save, x4
    assert router.pick(16, [1, 2, 3, 4]) == "a"
    router.pending = {"a": 0, "b": 0}
    router.kv_weight = 0.0  # the queue alone
    assert router.pick(16, [1, 2, 3, 4]) == "a"


def test_kv_routes_a_turn_back_to_the_t_node_holding_its_blocks_and_charges_its_tokens():
    """Decode-side reuse: a T-node's cost weighs the prompt tokens it lacks (what its P-node
    would stream), and its queue is charged the request's tokens to generate."""
    router = kv_router()
    router.kv_events("b", {"cursor": "e:1", "events": [["stored", [1, 2, 3]]]})
    node, charged = router.route(8, [1, 2, 3, 4], prompt_tokens=16)
    assert (node, charged) == ("b", 8) and router.pending == {"a": 0, "b": 8}
    router.pending["b"] = 60  # a queue that outweighs the 12 tokens not streamed, x4
    assert router.route(8, [1, 2, 3, 4], prompt_tokens=16) == ("a", 8)


def test_kv_index_follows_removals_and_resets_and_needs_every_block_from_the_first():
    router = kv_router()
    router.kv_events("b", {"cursor": "e:1", "events": [["stored", [1, 2, 3]]]})
    router.kv_events("b", {"cursor": "e:2", "events": [["removed", [1]]]})
    assert router.index.overlap("b", [1, 2, 3]) == 0  # its first block is gone
    router.kv_events("b", {"cursor": "f:7", "reset": [1, 2]})  # the node started again
    assert router.index.overlap("b", [1, 2, 3]) == 2 and router.kv_cursor("b") == "f:7"


def test_a_lost_node_leaves_the_kv_index_at_once():
    router = kv_router()
    router.kv_events("b", {"cursor": "e:1", "events": [["stored", [1, 2]]]})
    router.mark_down("b")
    assert router.index.overlap("b", [1, 2]) == 0 and router.kv_cursor("b") == ""
    router.kv_events("b", {"cursor": "e:2", "events": [["stored", [1, 2]]]})  # late: dropped
    assert router.index.overlap("b", [1, 2]) == 0


def test_round_robin_takes_turns_over_the_live_nodes():
    router = Router(["a", "b", "c"], policy="round-robin", down_s=60)
    router.pending["a"] = 1000  # queues do not matter
    assert [router.pick(1) for _ in range(4)] == ["a", "b", "c", "a"]
    router.mark_down("b")
    assert {router.pick(1) for _ in range(4)} == {"a", "c"}
    with pytest.raises(ValueError, match="router policy must be one of"):
        Router(["a"], policy="random")


def test_a_node_that_refused_a_slot_is_passed_over_for_a_while():
    """Another frontend's requests fill a node this router counts as empty: once it refuses,
    requests go to a node with room at once; with every node refused, to the fewest pending
    (there they wait for a slot); and the node is tried again after ``for_s``."""
    router = Router(["a", "b"])
    router.mark_full("a", 60)
    assert router.has_room()
    assert [router.pick(1) for _ in range(3)] == ["b", "b", "b"]
    router.mark_full("b", 60)
    assert not router.has_room()
    assert router.pick(1) == "a"  # a: 1 pending, b: 3
    router.mark_full("a", 0)
    router.mark_down("b")
    assert router.has_room() and router.pick(1) == "a"
