"""A local cluster of tritonservers: a frontend, P-nodes and token pipelines on loopback.

``dejavu up`` starts them, waits until each is ready, connects the stages of
every token pipeline, and writes ``<dir>/cluster.json`` (roles, pipelines and
stages, addresses, pids, logs; one log per node in ``<dir>/logs``);
``dejavu status`` and ``dejavu down`` read it. Tests use :meth:`Cluster.up`,
a context manager over the same code; ``dejavu up --spec FILE`` starts what
the planner's cluster spec says (:mod:`orchestrator.planner.planner`).

A token pipeline of depth D_t is D_t T-nodes, one stage each; stage 0 is its
head and serves the frontend. A P-node runs D_p prompt stages in its one
process. Bootstrap: once every node is ready, the launcher asks each stage for
its endpoints and sends each its successor's and stage 0's (control requests
to the decode model), then starts stages 1..D-1 and stage 0 last. Depth-1
pipelines start themselves.

Colocated mode has no P-nodes: each T-node (depth 1) prefills its own prompts
(the baseline that disaggregation is measured against).

The fault controller (:mod:`orchestrator.fault.controller`) runs as a process of
its own on loopback, started before the nodes and stopped after them; every P-
and T-node registers with it and heartbeats (``controller`` model parameter),
and ``dejavu status`` shows its view. If the controller dies, serving goes on:
the nodes keep serving and re-register when it returns, but a node that fails
while it is away is not declared dead until it is back (the library's
behaviour, see :mod:`orchestrator.fault.client`).

A supervisor process (:mod:`orchestrator.cluster.supervisor`) starts lost
nodes again. With ``replicate`` (the default for pipelines deeper than 1)
every T-stage streams its KV replicas to the next stage, and a lost stage is
recovered from them: its requests pause instead of starting over.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from orchestrator.cluster.devices import Devices, parse_assignments
from orchestrator.cluster.tritonserver import (
    ROOT,
    ServerError,
    TritonServer,
    add_model,
    alive,
    clean_shm,
    free_port,
    is_ready,
    make_backend_dir,
    stop_processes,
    stop_servers,
)
from orchestrator.fault import REPLICATE_MODES

STATE_FILE = "cluster.json"
SWAP_MODES = ("on", "off", "auto")
ROLE_MODELS = {
    "frontend": ("preprocessing", "postprocessing", "orchestrator", "ensemble"),
    "prefill": ("prefill",),
    "decode": ("decode",),
}


def write_node_repo(repo: Path, role: str, params: dict[str, str]) -> None:
    """The model repository of one node; every model sees every parameter it may need."""
    if role not in ROLE_MODELS:
        raise ValueError(f"role must be one of {', '.join(ROLE_MODELS)}, got {role!r}")
    for model in ROLE_MODELS[role]:
        add_model(repo, model, params if model != "ensemble" else None)


@dataclass
class Node:
    role: str  # frontend | prefill | decode
    server: TritonServer
    pipeline: int | None = None  # which P- or T-pipeline
    stage: int | None = None  # T-nodes: its stage in the pipeline (P-nodes run all theirs)
    depth: int | None = None  # the pipeline's depth
    params: dict[str, str] | None = None  # its models' parameters (to start it again)

    def describe(self) -> dict:
        s = self.server
        return {
            "repo": str(s.repo),
            "params": self.params,
            "name": s.name,
            "role": self.role,
            "pipeline": self.pipeline,
            "stage": self.stage,
            "depth": self.depth,
            "http": s.http_url,
            "grpc": s.grpc_url,
            "metrics": f"127.0.0.1:{s.metrics_port}",
            "pid": s.process.pid if s.process else None,
            "devices": None if s.devices is None else str(s.devices),
            "log": str(s.log_path),
            "shm_prefix": s.shm_prefix,
        }


class Cluster:
    def __init__(
        self,
        model_dir: str | Path,
        prefill: int = 1,
        decode: int = 1,
        colocated: bool = False,
        run_dir: str | Path = "runs/local",
        max_seq_len: int | None = None,
        max_batch: int = 16,
        prefill_depth: int = 1,
        decode_depth: int = 1,
        swap: str = "off",
        dead_after_s: float = 10.0,
        controller_timeout_s: float = 5.0,
        replicate: str = "on",
        devices: dict[str, Devices] | None = None,
    ) -> None:
        """``prefill``/``decode``: how many P- and T-pipelines, of depths ``prefill_depth``
        and ``decode_depth``; ``max_batch``: sequences per microbatch of a T-pipeline;
        ``controller_timeout_s``: the fault controller declares a node silent this long dead;
        ``replicate``: on: T-stages (of pipelines deeper than 1) stream KV replicas to their
        successor; disk: to their local disk; a lost stage is recovered from them; off:
        none (a lost stage costs its pipeline's requests a rerun); ``devices``: {node name:
        its cores or GPUs} (nodes not named run anywhere, as by default)."""
        if decode < 1:
            raise ValueError("a cluster needs at least one decode node")
        if not colocated and prefill < 1:
            raise ValueError("disaggregated mode needs at least one prefill node")
        if prefill_depth < 1 or decode_depth < 1:
            raise ValueError(f"depths must be >= 1, got prefill {prefill_depth}, "
                             f"decode {decode_depth}")
        if colocated and decode_depth != 1:
            raise ValueError("colocated pipelines deeper than 1 are not supported on Triton "
                             "nodes (prompts enter a pipeline only within one process)")
        if replicate not in REPLICATE_MODES:
            raise ValueError(f"replicate must be one of {REPLICATE_MODES}, got {replicate!r}")
        if swap not in SWAP_MODES:
            raise ValueError(f"swap must be one of {SWAP_MODES}, got {swap!r}")
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a model folder (no config.json)")
        self.colocated = colocated
        self.replicate = replicate if decode_depth > 1 else "off"
        self.run_dir = Path(run_dir).resolve()
        self.supervisor: subprocess.Popen | None = None
        self.secret = secrets.token_hex(16)
        self.controller = Controller(free_port(), controller_timeout_s,
                                     self.run_dir / "logs" / "controller.log")
        self.common = {
            "controller": self.controller.address,
            "model_dir": str(self.model_dir),
            "max_seq_len": str(max_seq_len or ""),
            "max_batch": str(max_batch),
            "swap": swap,
            "dead_after_s": str(dead_after_s),
            "prefill_depth": str(prefill_depth),
            "replicate": self.replicate,
        }
        self.backend_dir = make_backend_dir(self.run_dir / "backends")
        shutil.rmtree(self.run_dir / "replicas", ignore_errors=True)  # a former cluster's
        self.devices = dict(devices or {})
        self.nodes: list[Node] = []
        for p in range(0 if colocated else prefill):
            self._add_node(Node("prefill", None, p, None, prefill_depth), f"prefill{p}")
        for p in range(decode):
            for i in range(decode_depth):
                self._add_node(Node("decode", None, p, i, decode_depth),
                               decode_name(p, i, decode_depth))
        self._add_node(Node("frontend", None), "frontend")
        unknown = set(self.devices) - {n.server.name for n in self.nodes}
        if unknown:
            raise ValueError(f"devices for nodes this cluster does not have: "
                             f"{', '.join(sorted(unknown))} (it has "
                             f"{', '.join(n.server.name for n in self.nodes)})")

    @classmethod
    def from_spec(cls, spec: dict, **kwargs) -> Cluster:
        """The nodes a planner cluster spec asks for (``kwargs``: run_dir, max_seq_len, ...)."""
        version = spec.get("version")
        if version != 1:
            raise ValueError(f"cluster spec version {version!r}: only version 1 is known")
        mode, prefill, decode = spec.get("mode"), spec.get("prefill"), spec.get("decode")
        if mode not in ("disaggregated", "colocated") or not isinstance(decode, dict):
            raise ValueError("a cluster spec needs mode (disaggregated | colocated) and "
                             "decode {pipelines, depth}")
        if mode == "disaggregated" and not isinstance(prefill, dict):
            raise ValueError("a disaggregated cluster spec needs prefill {pipelines, depth}")
        if spec.get("batch"):
            kwargs.setdefault("max_batch", int(spec["batch"]))
        if spec.get("devices") and not kwargs.get("devices"):
            kwargs["devices"] = parse_assignments(
                [f"{name}={d}" for name, d in spec["devices"].items()])
        prefill = prefill or {"pipelines": 0, "depth": 1}
        return cls(
            spec["model_dir"], int(prefill["pipelines"]), int(decode["pipelines"]),
            mode == "colocated", prefill_depth=int(prefill["depth"]),
            decode_depth=int(decode["depth"]), **kwargs,
        )

    def _add_node(self, node: Node, name: str) -> None:
        repo = self.run_dir / "repos" / name
        shutil.rmtree(repo, ignore_errors=True)
        devices = self.devices.get(name)
        node.server = TritonServer(
            name, repo, self.backend_dir, self.run_dir / "logs" / f"{name}.log",
            devices=devices,
        )
        params = {
            **self.common,
            "secret": self.secret,
            "name": f"{name}-{node.server.grpc_port}",
            "address": node.server.grpc_url,
            "replica_dir": str(self.run_dir / "replicas" / name),  # replicate=disk
            "pipeline": str(node.pipeline if node.pipeline is not None else ""),
            "mode": "colocated" if self.colocated else "disaggregated",
            "depth": str(node.depth or 1),
            "stage": str(node.stage or 0),
            "prefill_urls": ",".join(n.server.grpc_url for n in self.role("prefill")),
            "decode_urls": ",".join("+".join(n.server.grpc_url for n in stages)
                                    for stages in self.decode_pipelines()),
            **device_params(devices),
        }
        write_node_repo(repo, node.role, params)
        node.params = params
        self.nodes.append(node)

    def decode_pipelines(self) -> list[list[Node]]:
        """Each token pipeline's nodes, stage 0 first."""
        pipelines: dict[int, list[Node]] = {}
        for node in self.role("decode"):
            pipelines.setdefault(node.pipeline, []).append(node)
        return [sorted(nodes, key=lambda n: n.stage) for _, nodes in sorted(pipelines.items())]

    def role(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role]

    @property
    def frontend(self) -> TritonServer:
        return self.role("frontend")[0].server

    def start(self, timeout_s: float = 180.0) -> None:
        try:
            self.controller.start()
            for node in self.nodes:
                node.server.launch()
            for node in self.nodes:
                node.server.wait_ready(timeout_s)
            for stages in self.decode_pipelines():
                if len(stages) > 1:
                    connect_pipeline([n.server.grpc_url for n in stages], timeout_s,
                                     self.replicate != "off")
            self.write_state()
            self.start_supervisor()
        except BaseException:
            self.stop()
            raise
        self.write_state()

    def start_supervisor(self) -> None:
        log_path = self.run_dir / "logs" / "supervisor.log"
        with open(log_path, "ab") as log:
            self.supervisor = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cluster.supervisor", "--dir",
                 str(self.run_dir)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True)

    def stop(self) -> None:
        """Stop what the state file describes (the supervisor may have started nodes again),
        then reap this process's own children."""
        path = self.run_dir / STATE_FILE
        if path.is_file():
            stop_described(json.loads(path.read_text()))
        if self.supervisor is not None:
            stop_processes([self.supervisor.pid], timeout_s=5.0)
            self.supervisor.wait(timeout=5)
        stop_servers([node.server for node in self.nodes])
        self.controller.stop()
        path.unlink(missing_ok=True)

    def write_state(self) -> None:
        state = {
            "mode": "colocated" if self.colocated else "disaggregated",
            "model_dir": str(self.model_dir),
            "frontend": {"http": self.frontend.http_url, "grpc": self.frontend.grpc_url},
            "controller": self.controller.describe(),
            "supervisor": {"pid": self.supervisor.pid if self.supervisor else None,
                           "log": str(self.run_dir / "logs" / "supervisor.log")},
            "backends": str(self.backend_dir),
            "nodes": [n.describe() for n in self.nodes],
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    @contextmanager
    def up(cls, model_dir: str | Path, timeout_s: float = 180.0, **kwargs) -> Iterator[Cluster]:
        cluster = cls(model_dir, **kwargs)
        cluster.start(timeout_s)
        try:
            yield cluster
        finally:
            cluster.stop()


def decode_name(pipeline: int, stage: int, depth: int) -> str:
    return f"decode{pipeline}" if depth == 1 else f"decode{pipeline}s{stage}"


def spread_devices(spec: dict, machines: list[Devices]) -> dict[str, str]:
    """A planner spec's nodes on ``machines`` (one device set per machine, in order): a
    P-node takes its D_p machines' devices (its stages run in one process), a T-stage one."""
    prefill, decode = spec.get("prefill") or {"pipelines": 0, "depth": 1}, spec["decode"]
    wants = [(f"prefill{p}", int(prefill["depth"])) for p in range(int(prefill["pipelines"]))]
    depth = int(decode["depth"])
    wants += [(decode_name(p, i, depth), 1)
              for p in range(int(decode["pipelines"])) for i in range(depth)]
    if sum(n for _, n in wants) > len(machines):
        raise ValueError(f"the spec's nodes need {sum(n for _, n in wants)} machines, "
                         f"{len(machines)} devices given")
    out, at = {}, 0
    for name, count in wants:
        mine = machines[at:at + count]
        if len({d.kind for d in mine}) != 1:
            raise ValueError(f"{name} would get devices of mixed kinds: {mine}")
        out[name] = str(Devices(mine[0].kind, tuple(sorted({i for d in mine for i in d.ids}))))
        at += count
    return out


def device_params(devices: Devices | None) -> dict[str, str]:
    """A pinned node's model parameters: its devices, and torch threads to match."""
    if devices is None:
        return {}
    threads = {} if devices.threads is None else {"threads": str(devices.threads)}
    return {"devices": str(devices), **threads}


@dataclass
class Controller:
    """The fault controller's process (``python -m orchestrator.fault.controller``)."""

    port: int
    timeout_s: float
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            seen = log.tell()  # started again: only this run's lines count
            self.process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.fault.controller", "--port", str(self.port),
                 "--timeout-s", str(self.timeout_s)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True,  # like the nodes: Ctrl-C in a shell must not stop it
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the controller exited with {self.process.returncode}; "
                                  f"log {self.log_path}")
            if re.search(rf"controller listening on {re.escape(self.address)}",
                         self.log_path.read_bytes()[seen:].decode(errors="replace")):
                return
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"the controller did not listen on {self.address} within "
                          f"{timeout_s:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process.pid], timeout_s=5.0)
            self.process.wait(timeout=5)

    def describe(self) -> dict:
        return {"address": self.address, "pid": self.process.pid if self.process else None,
                "timeout_s": self.timeout_s, "log": str(self.log_path)}


def connect_pipeline(urls: list[str], timeout_s: float, replicate: bool = False) -> None:
    """Wire the stages of one token pipeline (gRPC urls, stage 0 first; with ``replicate``
    each one's KV replicas to the next), then start them."""
    from orchestrator.serving.frontend import control  # tritonclient: only where needed

    try:
        endpoints = [control(url, "endpoints", timeout_s) for url in urls]
        for i, url in enumerate(urls):
            peers = [endpoints[(i + 1) % len(urls)], endpoints[0]]
            control(url, "connect", timeout_s, peers=peers)
        if replicate:
            replicas = [control(url, "replica_endpoints", timeout_s) for url in urls]
            for i, url in enumerate(urls):
                peers = [replicas[(i + 1) % len(urls)], replicas[i - 1]]
                control(url, "replicate", timeout_s, peers=peers)
        for url in [*urls[1:], urls[0]]:  # the head last: it starts counting heartbeats
            control(url, "start", timeout_s)
    except Exception as exc:
        raise ServerError(f"could not connect the token pipeline {' -> '.join(urls)}: "
                          f"{exc}") from exc


def read_state(run_dir: str | Path) -> dict:
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no cluster running from {run_dir} (no {path})")
    return json.loads(path.read_text())


def _dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="runs/local", help="the cluster's folder")


def up_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu up", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (config.json, weights)")
    parser.add_argument("--spec", type=Path, help="a planner cluster spec (JSON): its model, "
                        "mode and pipelines replace --model, --prefill, --decode, the depths")
    parser.add_argument("--prefill", type=int, default=1, help="number of P-pipelines")
    parser.add_argument("--decode", type=int, default=1, help="number of T-pipelines")
    parser.add_argument("--prefill-depth", type=int, default=1,
                        help="prompt stages per P-node (D_p, in one process)")
    parser.add_argument("--decode-depth", type=int, default=1,
                        help="T-nodes per token pipeline (D_t, one stage each)")
    parser.add_argument("--swap", choices=SWAP_MODES, default="off",
                        help="microbatch swapping on the T-stages")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences per microbatch")
    parser.add_argument("--colocated", action="store_true", help="T-nodes prefill themselves")
    parser.add_argument("--max-seq-len", type=int, help="KV slot size (default: model's)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for ready")
    parser.add_argument("--controller-timeout", type=float, default=5.0,
                        help="the fault controller declares a node silent this long dead")
    parser.add_argument("--replicate", choices=REPLICATE_MODES, default="on",
                        help="T-stages stream KV replicas to the next stage (disk: to local "
                        "disk); a lost stage is started again and resumes from them "
                        "(pipelines deeper than 1)")
    parser.add_argument("--devices", nargs="+", default=[], metavar="NODE=DEVICES",
                        help="pin nodes to devices, e.g. prefill0=cpu:0 decode0=cpu:1 "
                        "(cores; cuda:0 sets CUDA_VISIBLE_DEVICES); replaces the spec's")
    _dir_argument(parser)
    args = parser.parse_args(argv)
    if (Path(args.dir) / STATE_FILE).exists():
        if any(is_ready(n["http"]) for n in read_state(args.dir)["nodes"]):
            print(f"a cluster is up in {args.dir}: run `dejavu down` first", file=sys.stderr)
            return 1
        (Path(args.dir) / STATE_FILE).unlink()  # left by a cluster that died
    try:
        common = dict(run_dir=args.dir, max_seq_len=args.max_seq_len, swap=args.swap,
                      controller_timeout_s=args.controller_timeout, replicate=args.replicate,
                      devices=parse_assignments(args.devices))
        if args.spec is not None:
            cluster = Cluster.from_spec(json.loads(args.spec.read_text()), **common)
        elif args.model is None:
            raise ValueError("give --model DIR or --spec FILE")
        else:
            cluster = Cluster(
                args.model, args.prefill, args.decode, args.colocated,
                max_batch=args.max_batch, prefill_depth=args.prefill_depth,
                decode_depth=args.decode_depth, **common,
            )
        cluster.start(args.timeout)
    except (ValueError, ServerError, OSError) as exc:
        print(f"dejavu up: {exc}", file=sys.stderr)
        return 1
    for node in cluster.nodes:
        s = node.server
        print(f"{s.name:<10} {node.role:<9} {_place(node.describe()):<14} "
              f"{_devices(node.describe()):<10} http {s.http_url}  grpc {s.grpc_url}  "
              f"log {s.log_path}")
    c = cluster.controller
    print(f"{'controller':<10} {'fault':<9} {'':<14} {'':<10} grpc {c.address}  "
          f"log {c.log_path}")
    print(f"ready: ensemble at http://{cluster.frontend.http_url} (state in {args.dir})")
    return 0


def _place(node: dict) -> str:
    """Where a node sits: ``pipeline 0 stage 1/3`` (P-nodes: ``pipeline 0 depth 2``)."""
    if node.get("pipeline") is None:
        return ""
    if node.get("stage") is None:
        return f"pipeline {node['pipeline']} depth {node['depth']}"
    return f"pipeline {node['pipeline']} stage {node['stage']}/{node['depth']}"


def _devices(node: dict) -> str:
    return node.get("devices") or "any"


def status_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu status", description="show the local cluster")
    parser.add_argument("--json", action="store_true", help="print the state as JSON")
    _dir_argument(parser)
    args = parser.parse_args(argv)
    try:
        state = read_state(args.dir)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    for node in state["nodes"]:
        node["ready"] = is_ready(node["http"])
    view = controller_view(state)
    if args.json:
        print(json.dumps(state, indent=2))
    else:
        print(f"mode {state['mode']}, model {state['model_dir']}")
        for n in state["nodes"]:
            ready = "ready" if n["ready"] else "DOWN"
            print(f"{n['name']:<10} {n['role']:<9} {_place(n):<22} {_devices(n):<10} {ready:<6} "
                  f"controller: {n['controller']:<12} http {n['http']}  pid {n['pid']}")
        where = f"controller {state['controller']['address']}"
        print(f"{where}: {view['error']}" if "error" in view else
              f"{where}: {len(view['nodes'])} nodes registered, declares dead after "
              f"{view['timeout_s']} s")
        supervisor = (state.get("supervisor") or {}).get("pid")
        if supervisor:
            print(f"supervisor pid {supervisor}: "
                  f"{'starts lost nodes again' if alive(supervisor) else 'GONE'}")
    healthy = "error" not in view and all(n["controller"] in ("alive", "-") for n in state["nodes"])
    return 0 if healthy and all(n["ready"] for n in state["nodes"]) else 1


def controller_view(state: dict) -> dict:
    """Ask the controller; mark each node of ``state`` alive, dead or unregistered in its
    view (``-``: the frontend does not register) and keep the answer in ``state``."""
    import grpc  # only where needed

    from orchestrator.fault.client import query_status

    controller = state.get("controller") or {}
    try:
        view = query_status(controller["address"])
    except KeyError:
        view = {"error": "none recorded in the state file"}
    except grpc.RpcError as exc:
        view = {"error": f"unreachable ({exc.code().name})"}
    controller["view"] = view
    registered = {n["address"]: n for n in view.get("nodes", [])}  # the latest per address
    for node in state["nodes"]:
        known = registered.get(node["grpc"])
        if node["role"] == "frontend":
            node["controller"] = "-"
        elif "error" in view:
            node["controller"] = "unknown"
        elif known is None:
            node["controller"] = "unregistered"
        else:
            node["controller"] = "alive" if known["alive"] else "dead"
    return view


def down_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu down", description="stop the local cluster")
    _dir_argument(parser)
    args = parser.parse_args(argv)
    try:
        state = read_state(args.dir)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    for what in stop_described(state):
        print(f"stopped {what}")
    (Path(args.dir) / STATE_FILE).unlink()
    return 0


def stop_described(state: dict) -> list[str]:
    """Stop the processes of a state file: the supervisor first (it would start nodes
    again), every node, then the controller. What was stopped, in that order."""
    stopped = []
    if (state.get("supervisor") or {}).get("pid"):
        stop_processes([state["supervisor"]["pid"]], timeout_s=5.0)
        stopped.append("the supervisor")
    stop_processes([node["pid"] for node in state["nodes"] if node["pid"]])
    for node in state["nodes"]:
        clean_shm(node["shm_prefix"])
        stopped.append(node["name"])
    if (state.get("controller") or {}).get("pid"):
        stop_processes([state["controller"]["pid"]], timeout_s=5.0)
        stopped.append("the controller")
    return stopped


def repo_main(argv: list[str]) -> int:
    """Write one node's model repository (containers: see docker-compose.yml)."""
    parser = argparse.ArgumentParser(prog="dejavu repo", description=repo_main.__doc__)
    parser.add_argument("role", choices=list(ROLE_MODELS))
    parser.add_argument("out", type=Path, help="model repository folder to write")
    parser.add_argument("--model", required=True, help="model folder as the node sees it")
    parser.add_argument("--secret", required=True, help="hex secret shared by the cluster")
    parser.add_argument("--name", default="", help="the node's KV transport name")
    parser.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    parser.add_argument("--prefill-urls", default="", help="comma-separated P-node gRPC urls")
    parser.add_argument("--decode-urls", default="", help="comma-separated T-node gRPC urls")
    parser.add_argument("--max-seq-len", default="")
    parser.add_argument("--depth", type=int, default=1, help="T-node: its pipeline's depth")
    parser.add_argument("--stage", type=int, default=0, help="T-node: its stage")
    parser.add_argument("--prefill-depth", type=int, default=1, help="P-node: prompt stages")
    parser.add_argument("--swap", choices=SWAP_MODES, default="off")
    args = parser.parse_args(argv)
    params = {
        "model_dir": args.model,
        "secret": args.secret,
        "name": args.name,
        "mode": args.mode,
        "prefill_urls": args.prefill_urls,
        "decode_urls": args.decode_urls,
        "max_seq_len": args.max_seq_len,
        "depth": str(args.depth),
        "stage": str(args.stage),
        "prefill_depth": str(args.prefill_depth),
        "swap": args.swap,
    }
    write_node_repo(args.out, args.role, params)
    print(f"wrote {args.role} repository to {args.out}")
    return 0
