"""m is measured by streaming a prefill's KV through the KV library to a real receiver."""

from __future__ import annotations

import time

import pytest

from orchestrator.engine.torch_engine import load_engine
from orchestrator.kv.errors import KVTransferError
from orchestrator.planner.kv_sink import KVSink
from orchestrator.planner.perf_model import Workload, measure_timings


def test_measure_timings_over_the_local_transport(tiny_model):
    engine = load_engine(tiny_model("gpt2"), max_seq_len=24)
    timings = measure_timings(engine, Workload(16, 4, batch=2), reps=2, transport="local")
    assert timings.transport == "local, 1 process"
    assert len(timings.prefill_s) == len(timings.streamed_prefill_s) == 2
    assert all(s > 0 for s in timings.streamed_prefill_s)
    assert timings.m == max(1.0, timings.m_raw) and timings.m_raw > 0


@pytest.mark.parametrize("kind", ["local", pytest.param("nixl", marks=pytest.mark.slow)])
@pytest.mark.timeout(120)
def test_a_prompt_that_never_arrives_fails_and_frees_its_slot(tiny_model, kind):
    layout = load_engine(tiny_model("gpt2"), max_seq_len=24).kv_layout
    with KVSink(layout, 1, kind, timeout_s=0.3) as sink:
        sink.reserve("lost", 8)
        with pytest.raises(KVTransferError, match="'lost', peer '<no sender>'.*nothing received"):
            sink.collect("lost")
        with pytest.raises(KVTransferError, match="no free KV slot"):
            sink.reserve("too-soon", 8)  # a late writer could still land in it
        time.sleep(0.4)  # ... until the quarantine (the receiver's timeout) is over
        sink.reserve("later", 8)


def test_unknown_transport(tiny_model):
    layout = load_engine(tiny_model("gpt2"), max_seq_len=24).kv_layout
    with pytest.raises(ValueError, match="unknown transport 'tcp'; choose from nixl, local"):
        KVSink(layout, 1, "tcp")


@pytest.mark.slow  # the receiver in a spawned process
@pytest.mark.timeout(60)
def test_a_dead_receiver_process_fails_fast(tiny_model):
    layout = load_engine(tiny_model("gpt2"), max_seq_len=24).kv_layout
    with KVSink(layout, 1, "nixl") as sink:
        sink._process.kill()  # as a crashed decode node
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="receiver process exited with code -9"):
            sink.reserve("orphan", 8)
        assert time.monotonic() - start < 5  # not the 70 s answer timeout
