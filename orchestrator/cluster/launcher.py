"""A local cluster of tritonservers: a frontend, P-nodes and T-nodes on loopback.

``dejavu up`` starts them, waits until each is ready and writes
``<dir>/cluster.json`` (roles, addresses, pids, logs; one log per node in
``<dir>/logs``); ``dejavu status`` and ``dejavu down`` read it. Tests use
:meth:`Cluster.up`, a context manager over the same code.

Colocated mode has no P-nodes: each T-node prefills its own prompts (the
baseline that disaggregation is measured against).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from orchestrator.cluster.tritonserver import (
    ServerError,
    TritonServer,
    add_model,
    clean_shm,
    is_ready,
    make_backend_dir,
    stop_processes,
    stop_servers,
)

STATE_FILE = "cluster.json"
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

    def describe(self) -> dict:
        s = self.server
        return {
            "name": s.name,
            "role": self.role,
            "http": s.http_url,
            "grpc": s.grpc_url,
            "metrics": f"127.0.0.1:{s.metrics_port}",
            "pid": s.process.pid if s.process else None,
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
    ) -> None:
        if decode < 1:
            raise ValueError("a cluster needs at least one decode node")
        if not colocated and prefill < 1:
            raise ValueError("disaggregated mode needs at least one prefill node")
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a model folder (no config.json)")
        self.colocated = colocated
        self.run_dir = Path(run_dir).resolve()
        self.secret = secrets.token_hex(16)
        self.common = {"model_dir": str(self.model_dir), "max_seq_len": str(max_seq_len or "")}
        self.max_batch = max_batch
        self.backend_dir = make_backend_dir(self.run_dir / "backends")
        self.nodes: list[Node] = []
        for i in range(0 if colocated else prefill):
            self._add_node("prefill", f"prefill{i}")
        for i in range(decode):
            self._add_node("decode", f"decode{i}")
        self._add_node("frontend", "frontend")

    def _add_node(self, role: str, name: str) -> None:
        repo = self.run_dir / "repos" / name
        shutil.rmtree(repo, ignore_errors=True)
        server = TritonServer(name, repo, self.backend_dir, self.run_dir / "logs" / f"{name}.log")
        params = {
            **self.common,
            "secret": self.secret,
            "name": f"{name}-{server.grpc_port}",
            "mode": "colocated" if self.colocated else "disaggregated",
            "max_batch": str(self.max_batch),
            "prefill_urls": ",".join(n.server.grpc_url for n in self.role("prefill")),
            "decode_urls": ",".join(n.server.grpc_url for n in self.role("decode")),
        }
        write_node_repo(repo, role, params)
        self.nodes.append(Node(role, server))

    def role(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role]

    @property
    def frontend(self) -> TritonServer:
        return self.role("frontend")[0].server

    def start(self, timeout_s: float = 180.0) -> None:
        try:
            for node in self.nodes:
                node.server.launch()
            for node in self.nodes:
                node.server.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.write_state()

    def stop(self) -> None:
        stop_servers([node.server for node in self.nodes])
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)

    def write_state(self) -> None:
        state = {
            "mode": "colocated" if self.colocated else "disaggregated",
            "model_dir": str(self.model_dir),
            "frontend": {"http": self.frontend.http_url, "grpc": self.frontend.grpc_url},
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


def read_state(run_dir: str | Path) -> dict:
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no cluster running from {run_dir} (no {path})")
    return json.loads(path.read_text())


def _dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="runs/local", help="the cluster's folder")


def up_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu up", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (config.json, weights)")
    parser.add_argument("--prefill", type=int, default=1, help="number of P-nodes")
    parser.add_argument("--decode", type=int, default=1, help="number of T-nodes")
    parser.add_argument("--colocated", action="store_true", help="T-nodes prefill themselves")
    parser.add_argument("--max-seq-len", type=int, help="KV slot size (default: model's)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for ready")
    _dir_argument(parser)
    args = parser.parse_args(argv)
    if (Path(args.dir) / STATE_FILE).exists():
        if any(is_ready(n["http"]) for n in read_state(args.dir)["nodes"]):
            print(f"a cluster is up in {args.dir}: run `dejavu down` first", file=sys.stderr)
            return 1
        (Path(args.dir) / STATE_FILE).unlink()  # left by a cluster that died
    try:
        cluster = Cluster(
            args.model, args.prefill, args.decode, args.colocated, args.dir, args.max_seq_len
        )
        cluster.start(args.timeout)
    except (ValueError, ServerError) as exc:
        print(f"dejavu up: {exc}", file=sys.stderr)
        return 1
    for node in cluster.nodes:
        s = node.server
        print(f"{s.name:<10} {node.role:<9} http {s.http_url}  grpc {s.grpc_url}  log {s.log_path}")
    print(f"ready: ensemble at http://{cluster.frontend.http_url} (state in {args.dir})")
    return 0


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
    if args.json:
        print(json.dumps(state, indent=2))
    else:
        print(f"mode {state['mode']}, model {state['model_dir']}")
        for n in state["nodes"]:
            ready = "ready" if n["ready"] else "DOWN"
            print(f"{n['name']:<10} {n['role']:<9} {ready:<6} http {n['http']}  pid {n['pid']}")
    return 0 if all(n["ready"] for n in state["nodes"]) else 1


def down_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu down", description="stop the local cluster")
    _dir_argument(parser)
    args = parser.parse_args(argv)
    try:
        state = read_state(args.dir)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    stop_processes([node["pid"] for node in state["nodes"] if node["pid"]])
    for node in state["nodes"]:
        clean_shm(node["shm_prefix"])
        print(f"stopped {node['name']}")
    (Path(args.dir) / STATE_FILE).unlink()
    return 0


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
    args = parser.parse_args(argv)
    params = {
        "model_dir": args.model,
        "secret": args.secret,
        "name": args.name,
        "mode": args.mode,
        "prefill_urls": args.prefill_urls,
        "decode_urls": args.decode_urls,
        "max_seq_len": args.max_seq_len,
    }
    write_node_repo(args.out, args.role, params)
    print(f"wrote {args.role} repository to {args.out}")
    return 0
