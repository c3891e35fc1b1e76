"""Devices per node: parsing, the planner spec's assignment, a node's model parameters."""

from __future__ import annotations

import os

import pytest

from orchestrator.cluster.devices import Devices, node_devices, parse_assignments
from orchestrator.cluster.launcher import Cluster, device_params, spread_devices

CORE = min(os.sched_getaffinity(0))


@pytest.mark.parametrize(("text", "kind", "ids"), [
    (f"cpu:{CORE}", "cpu", (CORE,)),
    (str(CORE), "cpu", (CORE,)),
    ("cuda:1,0", "cuda", (0, 1)),
    ("cuda:0-2", "cuda", (0, 1, 2)),
])
def test_parse(text, kind, ids):
    devices = Devices.parse(text)
    assert (devices.kind, devices.ids) == (kind, ids)
    assert Devices.parse(str(devices)) == devices


@pytest.mark.parametrize("text", ["tpu:0", "cpu:", "cpu:a", "cuda:-1", "cpu:100000"])
def test_parse_refuses(text):
    with pytest.raises(ValueError):
        Devices.parse(text)


def test_environment_and_threads():
    assert Devices.parse("cuda:0,1").environment() == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert Devices.parse("cuda:0").threads is None
    cpu = Devices.parse(f"cpu:{CORE}")
    assert cpu.threads == 1 and cpu.environment() == {"OMP_NUM_THREADS": "1"}
    assert device_params(cpu) == {"devices": f"cpu:{CORE}", "threads": 1}
    assert device_params(None) == {}
    assert node_devices(device_params(cpu)["devices"]) == cpu and node_devices("") is None


def test_assignments():
    assert parse_assignments([f"prefill0=cpu:{CORE}", "decode0=cuda:0"]) == {
        "prefill0": Devices("cpu", (CORE,)), "decode0": Devices("cuda", (0,))}
    with pytest.raises(ValueError, match="NODE=DEVICES"):
        parse_assignments(["cpu:0"])


def test_spread_over_a_spec():
    spec = {"prefill": {"pipelines": 1, "depth": 2}, "decode": {"pipelines": 2, "depth": 1}}
    machines = [Devices("cuda", (i,)) for i in range(5)]
    assert spread_devices(spec, machines) == {
        "prefill0": "cuda:0,1", "decode0": "cuda:2", "decode1": "cuda:3"}
    with pytest.raises(ValueError, match="need 4 machines"):
        spread_devices(spec, machines[:3])
    colocated = {"prefill": None, "decode": {"pipelines": 1, "depth": 2}}
    assert spread_devices(colocated, machines) == {"decode0s0": "cuda:0", "decode0s1": "cuda:1"}


def test_a_cluster_refuses_devices_for_nodes_it_has_not(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="decode7"):
        Cluster(tiny_model("llama"), run_dir=tmp_path,
                devices={"decode7": Devices("cpu", (CORE,))})
