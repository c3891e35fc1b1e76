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
