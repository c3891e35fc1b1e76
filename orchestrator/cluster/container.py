"""The cluster in containers (docker-compose, Kubernetes): nodes reach each other by name.

Every container gets the same topology flags as ``dejavu up`` and its own node
name, and asks the one writer (:func:`~orchestrator.cluster.topology.node_configs`)
for its configuration:

- ``dejavu repo NODE OUT``: write the node's model repository;
- ``dejavu node NODE``: write it, then become its ``tritonserver`` (every
  interface, ports 8000/8001/8002), under a fresh node id each start, so a
  restarted container is a new incarnation to the controller and the KV
  transports;
- ``dejavu supervise``: what the supervisor does under ``dejavu up``, less the
  starting (restart policies start lost containers again): connect the stages of
  each token pipeline, then carry out the controller's recovery plans.

``--dns compose`` (the default): a node is reached by its name (``decode0s1:8001``);
``--dns kubernetes``: by its StatefulSet pod's stable DNS name (``decode0-1.decode0``,
``prefill-0.prefill``), and a pod may name itself by its pod name (``decode0-1``).

The cluster secret comes from ``$DEJAVU_SECRET`` in every container.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import re
import secrets
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc

from orchestrator.cluster.devices import node_devices
from orchestrator.cluster.launcher import (
    connect_pipeline,
    device_params,
    settings_from,
    topology_arguments,
    topology_from,
)
from orchestrator.cluster.topology import node_configs, write_node_repo
from orchestrator.cluster.tritonserver import TritonServer, is_ready, make_backend_dir
from orchestrator.control.auth import UMASK, load_secret
from orchestrator.fault.client import query_status
from orchestrator.fault.rpc import Stub
from orchestrator.fault.stage_recovery import recover_stage
from orchestrator.serving.config import NodeConfig, Role

log = logging.getLogger("dejavu.supervise")
HTTP_PORT, GRPC_PORT, METRICS_PORT, CONTROLLER_PORT = 8000, 8001, 8002, 50051


def _parser(prog: str, doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    topology_arguments(parser)
    parser.add_argument("--controller", default=f"controller:{CONTROLLER_PORT}",
                        help="the fault controller's address (empty: none)")
    parser.add_argument("--dns", choices=["compose", "kubernetes"], default="compose",
                        help="how nodes reach each other: service names or StatefulSet pods")
    return parser


def kubernetes_host(name: str) -> str:
    """A node's stable DNS name in Kubernetes: its StatefulSet pod's (deploy/k8s)."""
    if match := re.fullmatch(r"prefill(\d+)", name):
        return f"prefill-{match[1]}.prefill"
    if match := re.fullmatch(r"decode(\d+)(?:s(\d+))?", name):
        return f"decode{match[1]}-{match[2] or 0}.decode{match[1]}"
    return name  # the frontend: a Service


def _host(args: argparse.Namespace, name: str) -> str:
    return kubernetes_host(name) if args.dns == "kubernetes" else name


def _configs(args: argparse.Namespace) -> dict[str, NodeConfig]:
    return node_configs(
        topology_from(args), lambda name: f"{_host(args, name)}:{GRPC_PORT}",
        lambda name: "/tmp/dejavu/replicas", model_dir=args.model, controller=args.controller,
        **settings_from(args))


def _node_config(args: argparse.Namespace) -> NodeConfig:
    """The config of ``args.node``: a node's name, or (Kubernetes) its pod's."""
    configs = _configs(args)
    by_pod = {_host(args, name).split(".")[0]: name for name in configs}
    name = args.node if args.node in configs else by_pod.get(args.node)
    if name is None:
        raise ValueError(f"no node {args.node!r} in this cluster: {', '.join(configs)}")
    args.node = name
    return configs[name]


def repo_main(argv: list[str]) -> int:
    """Write one node's model repository (a cluster whose nodes reach each other by name)."""
    parser = _parser("dejavu repo", repo_main.__doc__)
    parser.add_argument("node", help="frontend, prefill0, decode0 or decode0s1, ...")
    parser.add_argument("out", type=Path, help="model repository folder to write")
    parser.add_argument("--model", required=True, help="model folder as the node sees it")
    args = parser.parse_args(argv)
    try:
        config = _node_config(args)
    except ValueError as exc:
        print(f"dejavu repo: {exc}", file=sys.stderr)
        return 1
    shutil.rmtree(args.out, ignore_errors=True)
    write_node_repo(args.out, config)
    print(f"wrote {args.node}'s repository to {args.out}")
    return 0


def node_main(argv: list[str]) -> int:
    """Become one node of a cluster in containers: its repository, then its tritonserver."""
    parser = _parser("dejavu node", node_main.__doc__)
    parser.add_argument("node", help="frontend, prefill0, decode0 or decode0s1, ...")
    parser.add_argument("--model", required=True, help="model folder as the node sees it")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dejavu"),
                        help="where its repository and backend go")
    parser.add_argument("--devices", default=os.environ.get("DEJAVU_DEVICES", ""),
                        help="its cores or GPUs, e.g. cuda:0 (default: $DEJAVU_DEVICES)")
    parser.add_argument("--host", default=os.environ.get("DEJAVU_HOST", "127.0.0.1"),
                        help="the address it listens on (default: $DEJAVU_HOST, else "
                             "127.0.0.1); peers in other containers need 0.0.0.0")
    args = parser.parse_args(argv)
    try:
        config = _node_config(args)
        devices = node_devices(args.devices)
    except ValueError as exc:
        print(f"dejavu node: {exc}", file=sys.stderr)
        return 1
    # A fresh id per start: the controller refuses a dead node's id.
    config = replace(config, name=f"{args.node}-{secrets.token_hex(4)}",
                     **device_params(devices))
    repo = args.work / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    write_node_repo(repo, config)
    server = TritonServer(args.node, repo, make_backend_dir(args.work / "backends"),
                          args.work / "unused.log", HTTP_PORT, GRPC_PORT, METRICS_PORT,
                          host=args.host, devices=devices,
                          public=config.role is Role.FRONTEND)
    command = server.command()
    print(f"{config.name}: {shlex.join(command)}", flush=True)
    os.umask(UMASK)
    if devices is not None:
        devices.pin()
    os.execve(command[0], command, server.environment())  # its logs go to the container's


def supervise_main(argv: list[str]) -> int:
    """Connect every token pipeline's stages, then recover the stages restarted containers
    bring back, from their replicas (the controller's plans)."""
    parser = _parser("dejavu supervise", supervise_main.__doc__)
    parser.add_argument("--model", default="/model", help="model folder (for the writer)")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for a node to be ready")
    parser.add_argument("--ready-file", type=Path, help="touched once the pipelines are "
                        "connected (a healthcheck)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    configs = _configs(args)
    pipelines = {f"decode{i}": list(urls) for i, urls in enumerate(configs["frontend"].decode_urls)}
    replicates = any(c.replicates for c in configs.values())
    given_up: set[str] = set()
    for name, urls in pipelines.items():
        _wait_ready(urls, args.timeout)
        if len(urls) > 1:
            connect_pipeline(_call, urls, replicates)
            log.info("%s: stages connected (%s)", name, " -> ".join(urls))
    if args.ready_file is not None:
        args.ready_file.touch()
    print("supervising", flush=True)
    while True:
        time.sleep(args.poll_s)
        try:
            view = query_status(args.controller, load_secret())
        except grpc.RpcError:
            continue  # the controller is away (restarting): failures wait for it
        for name, pipeline in view["pipelines"].items():
            if pipeline["failed"] and name not in given_up:
                urls = pipelines.get(name, [])
                if not _recover(args.controller, name, urls, replicates, args.timeout):
                    given_up.add(name)


def _recover(controller: str, name: str, urls: list[str], replicates: bool,
             timeout_s: float) -> bool:
    """Once every lost node is back (its container restarted) and registered, carry out
    the controller's plan: a depth-1 pipeline (a P-node) just closes it, a lost T-stage is
    restored from replicas. False where it cannot be recovered here."""
    stub = Stub(controller, load_secret())
    try:
        plan = stub.call("Plan", {"pipeline": name}, 2.0)["plan"]
        if plan is None:
            return True  # a replacement has not registered yet
        if len(urls) <= 1:  # the frontend ran the lost node's requests elsewhere
            for node in query_status(controller, load_secret())["nodes"]:
                if node["pipeline"] == name and node["alive"]:
                    stub.call("Recovered", {"node_id": node["node_id"],
                                            "epoch": plan["epoch"]}, 2.0)
            log.warning("%s: its node is back (epoch %d)", name, plan["epoch"])
            return True
    finally:
        stub.close()
    if not replicates or 0 in plan["failed"]:
        # Its survivors would have to start afresh, which containers cannot do for each
        # other: the frontend ran the requests again on another pipeline.
        log.error("%s: stages %s lost %s; not recovered in containers", name, plan["failed"],
                  "with the head" if 0 in plan["failed"] else "without replicas")
        return False
    _wait_ready(urls, timeout_s)
    try:
        recover_stage(_call, urls, plan)
    except Exception as exc:
        # Its head would hold the requests until its recover timeout (minutes): it breaks
        # now, and the frontend runs them again on another pipeline.
        log.exception("%s: recovery failed; its head gives up now", name)
        with contextlib.suppress(Exception):  # a head that is gone gave up already
            _call(urls[0], "give_up", [f"recovery of stages {plan['failed']} failed: "
                                       f"{exc}".encode()])
        return False
    return True


@functools.cache
def _control():  # noqa: ANN202  (a ControlClient: one, its connections reused)
    from orchestrator.control.client import ControlClient  # tritonclient: only here

    return ControlClient(load_secret(), 60.0)  # $DEJAVU_SECRET


def _call(url: str, op: str, args: list[bytes]) -> bytes:
    return _control().call(url, op, args)


def _wait_ready(grpc_urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for url in grpc_urls:
        http = f"{url.rsplit(':', 1)[0]}:{HTTP_PORT}"  # its HTTP port: health
        while not is_ready(http):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{http} not ready after {timeout_s:.0f} s")
            time.sleep(1.0)
