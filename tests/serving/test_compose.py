"""The deployment files, checked offline: docker-compose.yml (CPU) and its GPU override
against the compose specification, the Kubernetes manifests against the Kubernetes
schemas, and both against the one config writer's topology."""

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

from orchestrator.cluster.container import kubernetes_host, repo_main
from orchestrator.cluster.launcher import settings_from, topology_arguments, topology_from
from orchestrator.cluster.topology import node_configs
from orchestrator.serving.config import TrtllmApi

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))


def check(*command: str) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def merge(base: dict, override: dict) -> dict:
    """docker-compose's merge of an override file (mappings merge, the rest replaces)."""
    merged = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = merge(base[key], value) if both else value
    return merged


def writer_nodes(flags: str) -> set[str]:
    parser = argparse.ArgumentParser()
    topology_arguments(parser)
    topology = topology_from(parser.parse_args(flags.split()))
    return set(node_configs(topology, lambda name: name, lambda name: "/r", model_dir="/m"))


def test_compose_files_follow_the_spec(tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gpu = merge(compose, yaml.safe_load((ROOT / "deploy/docker-compose.gpu.yml").read_text()))
    (tmp_path / "gpu.yml").write_text(yaml.safe_dump(gpu))
    for path in (ROOT / "docker-compose.yml", tmp_path / "gpu.yml"):
        check(str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    devices = {name: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
               for name, s in gpu["services"].items() if "deploy" in s}
    assert devices == {"prefill0": ["0"], "decode0s0": ["1"], "decode0s1": ["2"]}
    assert not any("deploy" in s for s in compose["services"].values())  # CPU: no GPUs


def test_compose_runs_the_writers_topology_with_health_and_init():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    flags = compose["x-topology"]["DEJAVU_TOPOLOGY"]
    nodes = {name for name, s in services.items() if "dejavu node" in s["command"][0]}
    assert nodes == writer_nodes(flags)
    assert {"controller", "supervisor"} <= set(services)
    for name, service in services.items():
        assert service["init"] and service["restart"] == "always", name
        assert "healthcheck" in service, name
        if name in nodes:
            assert f"exec dejavu node {name} " in service["command"][0]
            assert "pip" not in service["command"][0]


def test_kubernetes_manifests_validate_and_match_the_compose_topology():
    check(str(BIN / "kubernetes-validate"), "--strict", "--quiet", *map(str, K8S))
    docs = [d for path in K8S for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    flags = kinds["ConfigMap", "dejavu-topology"]["data"]["DEJAVU_TOPOLOGY"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert flags == compose["x-topology"]["DEJAVU_TOPOLOGY"]
    pods = {f"{name}-{i}" for (kind, name), d in kinds.items() if kind == "StatefulSet"
            for i in range(d["spec"]["replicas"])}
    nodes = writer_nodes(flags)
    frontends = {n for n in nodes if n.startswith("frontend")}  # one Deployment's replicas
    assert pods == {kubernetes_host(n).split(".")[0] for n in nodes} - frontends
    assert kinds["Deployment", "frontend"]["spec"]["replicas"] == len(frontends) == 2
    for kind, name in [("Deployment", "controller"), ("Deployment", "frontend"),
                       ("Deployment", "supervisor"), ("Service", "frontend"),
                       ("Service", "controller"), ("Secret", "dejavu-secret")]:
        assert (kind, name) in kinds
    for (kind, name), d in kinds.items():
        if kind == "StatefulSet":
            assert kinds["Service", name]["spec"]["clusterIP"] == "None"  # pod DNS names
            pod = d["spec"]["template"]["spec"]["containers"][0]
            assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert pod["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            assert pod["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
            assert {"secretRef": {"name": "dejavu-secret"}} in pod["envFrom"]


def test_every_node_writes_a_repository(tmp_path):
    for node, models in [("frontend", 6), ("prefill0", 1), ("decode0s1", 1)]:
        out = tmp_path / node
        assert repo_main([node, str(out), "--model", "/model", "--decode-depth", "2"]) == 0
        assert len([p for p in out.iterdir() if (p / "config.pbtxt").is_file()]) == models
    assert repo_main(["decode7", str(tmp_path / "x"), "--model", "/model"]) == 1


def test_compose_and_kubernetes_say_which_tensorrt_llm_they_serve():
    """``--trtllm-api`` in the one topology both deploy (legacy, as `dejavu up`'s default;
    llmapi serves TensorRT-LLM's LLM-API model as tensorrt_llm)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parser = argparse.ArgumentParser()
    topology_arguments(parser)
    flags = compose["x-topology"]["DEJAVU_TOPOLOGY"].split()
    assert settings_from(parser.parse_args(flags))["trtllm_api"] == TrtllmApi.LEGACY
    assert settings_from(parser.parse_args([*flags, "--trtllm-api", "llmapi"]))[
        "trtllm_api"] == TrtllmApi.LLMAPI


def test_compose_runs_two_frontends_that_clients_reach_on_ports_of_their_own():
    """Either frontend serves a client; each publishes the ensemble's HTTP and gRPC ports on
    loopback, at addresses of its own."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    frontends = [s for name, s in services.items() if name.startswith("frontend")]
    assert len(frontends) == 2
    published = [port.split(":")[1] for s in frontends for port in s["ports"]]
    assert len(set(published)) == 4 and all(p.startswith("${DEJAVU_") for p in published)
    assert all(port.startswith("127.0.0.1:") for s in frontends for port in s["ports"])
