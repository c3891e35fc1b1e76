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

Colocated mode has no P-nodes: each token pipeline runs its own prompts in its
steps, stage by stage (the baseline that disaggregation is measured against).

The fault controller (:mod:`orchestrator.fault.controller`) runs as a process of
its own on loopback, started before the nodes and stopped after them; every P-
and T-node registers with it and heartbeats (the ``controller`` field of its NodeConfig),
and ``dejavu status`` shows its view. If the controller dies, serving goes on:
the nodes keep serving and re-register when it returns, but a node that fails
while it is away is not declared dead until it is back (the library's
behaviour, see :mod:`orchestrator.fault.client`).

A supervisor process (:mod:`orchestrator.cluster.supervisor`) starts lost
nodes again. With ``replicate`` (the default for pipelines deeper than 1)
every T-stage streams its KV replicas to the next stage, and a lost stage is
recovered from them: its requests pause instead of starting over. With
``spares`` (``dejavu up --spares N``), N warm spare T-nodes wait loaded beside
the pipelines: a lost stage's role moves to one (no process start, no model
load in the pause) and the supervisor starts a new spare; ``prefill_spares``
(``--prefill-spares N``) does the same for a lost P-node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from orchestrator.cluster.devices import Devices, parse_assignments
from orchestrator.cluster.shm_namespace import ShmNamespace, start_namespace, stop_namespace
from orchestrator.cluster.topology import Topology, decode_name, node_configs, write_node_repo
from orchestrator.cluster.tritonserver import (
    ServerError,
    TritonServer,
    alive,
    clean_shm,
    free_port,
    is_ready,
    make_backend_dir,
    stop_processes,
    stop_servers,
)
from orchestrator.cluster.watchdog import STATE_FILE, STOPPING, read_pid, spawn, start_module
from orchestrator.control.auth import (
    load_secret,
    new_secret,
    open_private,
    write_secret,
)
from orchestrator.fault import ReplicateMode
from orchestrator.pipeline import DEAD_AFTER_S, SwapMode
from orchestrator.serving.config import NodeConfig, Role, TrtllmApi
from orchestrator.serving.router import DEFAULT_KV_WEIGHT

Call = Callable[[str, str, list[bytes]], bytes]  # (node url, op, args) -> reply
SECRET_FILE = "secret"
OPENAI_STANDBY = "openai.standby"  # the FIFO the OpenAI API's warm spare waits on


@dataclass
class Node:
    config: NodeConfig  # its models' configuration (to start it again)
    server: TritonServer

    @property
    def role(self) -> Role:
        return self.config.role

    def describe(self) -> dict:
        s, c = self.server, self.config
        return {
            "repo": str(s.repo),
            "config": asdict(c),
            "name": s.name,
            "role": c.role.value,
            "pipeline": None if c.role is Role.FRONTEND or c.role.spare else c.pipeline,
            "stage": c.stage if c.role is Role.DECODE else None,
            "depth": {Role.PREFILL: c.prefill_depth, Role.DECODE: c.depth,
                      Role.SPARE: c.depth, Role.PREFILL_SPARE: c.prefill_depth}.get(c.role),
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
        prefill_depth: int = 1,
        decode_depth: int = 1,
        controller_timeout_s: float = DEAD_AFTER_S,
        devices: dict[str, Devices] | None = None,
        spares: int = 0,
        frontends: int = 1,
        openai: bool = True,
        prefill_spares: int = 0,
        prefill_profile: str = "",
        **settings,
    ) -> None:
        """``prefill``/``decode``: how many P- and T-pipelines, of depths ``prefill_depth``
        and ``decode_depth``; ``controller_timeout_s``: the fault controller declares a node
        silent this long dead; ``settings``: :class:`NodeConfig` fields for every node
        (``max_batch``, ``max_seq_len``, ``swap``, ``replicate``: on: T-stages of pipelines
        deeper than 1 stream KV replicas to their successor; disk: to their local disk; a
        lost stage is recovered from them; off: none, a lost stage costs its pipeline's
        requests a rerun); ``devices``: {node name: its cores or GPUs} (nodes not named run
        anywhere, as by default); ``spares``: warm spare T-nodes that take over a lost
        stage (pipelines deeper than 1, replicate on); ``frontends``: frontend nodes, each
        serving the whole contract and routing to the shared pools itself (a T-node refuses
        a slot it does not have, so they never book one twice); ``openai``: also start the
        OpenAI-compatible API (loopback, in front of every frontend); ``prefill_profile``:
        the P-nodes' own engine profile (mixed machines, :func:`node_configs`);
        ``prefill_spares``: warm spare P-nodes that take over a lost P-node."""
        topology = Topology(prefill, decode, prefill_depth, decode_depth, colocated, spares,
                            frontends, prefill_spares)
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a model folder (no config.json)")
        self.colocated = colocated
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.chmod(0o700)
        self.supervisor: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None
        self.namespace: ShmNamespace | None = None  # the nodes' private /dev/shm
        # Readable by this user only; the models get its path, never the secret.
        self.secret_file = write_secret(self.run_dir / SECRET_FILE, new_secret())
        self.controller = Controller(self.run_dir / "logs" / "controller.log", port=free_port(),
                                     timeout_s=controller_timeout_s, secret_file=self.secret_file)
        self.backend_dir = make_backend_dir(self.run_dir / "backends")
        shutil.rmtree(self.run_dir / "replicas", ignore_errors=True)  # a former cluster's
        self.devices = dict(devices or {})
        servers: dict[str, TritonServer] = {}

        def address(name: str) -> str:
            if name not in servers:
                servers[name] = TritonServer(name, self.run_dir / "repos" / name,
                                             self.backend_dir,
                                             self.run_dir / "logs" / f"{name}.log",
                                             devices=self.devices.get(name))
            return servers[name].grpc_url

        configs = node_configs(
            topology, address, lambda name: str(self.run_dir / "replicas" / name),
            prefill_profile, model_dir=str(self.model_dir), controller=self.controller.address,
            secret_file=str(self.secret_file), **settings)
        unknown = set(self.devices) - set(configs)
        if unknown:
            raise ValueError(f"devices for nodes this cluster does not have: "
                             f"{', '.join(sorted(unknown))} (it has {', '.join(configs)})")
        self.nodes: list[Node] = []
        for name, config in configs.items():
            server = servers[name]
            # A per-run id: the controller and the KV transports tell clusters apart.
            config = replace(config, name=f"{name}-{server.grpc_port}",
                             **device_params(self.devices.get(name)))
            server.public = config.role is Role.FRONTEND
            shutil.rmtree(server.repo, ignore_errors=True)
            write_node_repo(server.repo, config)
            self.nodes.append(Node(config, server))
        self.openai = (OpenAIApi(self.run_dir / "logs" / "openai.log", port=free_port(),
                                 grpc_url=",".join(s.grpc_url for s in self.frontends),
                                 model_dir=self.model_dir)
                       if openai else None)

    @classmethod
    def from_spec(cls, spec: dict, **kwargs) -> Cluster:
        """The nodes a planner cluster spec asks for (``kwargs``: run_dir, max_seq_len, ...)."""
        topology, settings = Topology.from_spec(spec)
        if spec.get("devices") and not kwargs.get("devices"):
            kwargs["devices"] = parse_assignments(
                [f"{name}={d}" for name, d in spec["devices"].items()])
        return cls(settings.pop("model_dir"), topology.prefill, topology.decode,
                   topology.colocated, prefill_depth=topology.prefill_depth,
                   decode_depth=topology.decode_depth, **{**settings, **kwargs})

    def decode_pipelines(self) -> list[list[Node]]:
        """Each token pipeline's nodes, stage 0 first."""
        pipelines: dict[int, list[Node]] = {}
        for node in self.role(Role.DECODE):
            pipelines.setdefault(node.config.pipeline, []).append(node)
        return [sorted(nodes, key=lambda n: n.config.stage)
                for _, nodes in sorted(pipelines.items())]

    def role(self, role: Role | str) -> list[Node]:
        return [n for n in self.nodes if n.role == role]

    @property
    def frontend(self) -> TritonServer:
        return self.frontends[0]

    @property
    def frontends(self) -> list[TritonServer]:
        """Every frontend's server, ``frontend`` first."""
        return [node.server for node in self.role(Role.FRONTEND)]

    def start(self, timeout_s: float = 180.0) -> None:
        try:
            (self.run_dir / STOPPING).unlink(missing_ok=True)  # a former cluster's down left it
            self.namespace = start_namespace(self.run_dir / "logs" / "namespace.log")
            self.controller.start()
            for node in self.nodes:
                node.server.namespace = self.namespace
                node.server.launch()
            if self.openai is not None:  # it needs no node to start: while they load
                self.openai.start(timeout_s)
            for node in self.nodes:
                node.server.wait_ready(timeout_s)
            pipelines = [stages for stages in self.decode_pipelines() if len(stages) > 1]
            if pipelines:
                from orchestrator.control.client import ControlClient  # tritonclient

                control = ControlClient(load_secret(self.secret_file), timeout_s)
                try:
                    for stages in pipelines:
                        connect_pipeline(control.call, [n.server.grpc_url for n in stages],
                                         stages[0].config.replicates)
                finally:
                    control.close()
            self.write_state()  # from here on only the supervisor writes it
            self.start_supervisor()
        except BaseException:
            self.stop()
            raise

    def start_supervisor(self) -> None:
        """The supervisor and its watchdog: each starts the other again if it dies."""
        self.supervisor = spawn(self.run_dir, "supervisor")
        self.watchdog = spawn(self.run_dir, "watchdog")

    def stop(self) -> None:
        """Stop what the state file describes (the supervisor may have started nodes again),
        then reap this process's own children."""
        path = self.run_dir / STATE_FILE
        if path.is_file():
            stop_described(self.run_dir)
        for process in (self.watchdog, self.supervisor):  # reap them
            if process is not None:
                stop_processes([process.pid], timeout_s=5.0)
                process.wait(timeout=5)
        stop_servers([node.server for node in self.nodes])
        stop_namespace(self.namespace)
        self.controller.stop()
        if self.openai is not None:
            self.openai.stop()
        path.unlink(missing_ok=True)

    def write_state(self) -> None:
        state = {
            "mode": "colocated" if self.colocated else "disaggregated",
            "model_dir": str(self.model_dir),
            "secret_file": str(self.secret_file),
            "frontend": {"http": self.frontend.http_url, "grpc": self.frontend.grpc_url},
            "frontends": [{"name": s.name, "http": s.http_url, "grpc": s.grpc_url}
                          for s in self.frontends],
            "controller": self.controller.describe(),
            "openai": self.openai.describe() if self.openai else None,
            "supervisor": {"log": str(self.run_dir / "logs" / "supervisor.log")},
            "backends": str(self.backend_dir),
            "namespace": self.namespace.describe() if self.namespace else None,
            "nodes": [n.describe() for n in self.nodes],
        }
        with open_private(self.run_dir / STATE_FILE) as f:
            f.write(json.dumps(state, indent=2) + "\n")

    @classmethod
    @contextmanager
    def up(cls, model_dir: str | Path, timeout_s: float = 180.0, **kwargs) -> Iterator[Cluster]:
        cluster = cls(model_dir, **kwargs)
        cluster.start(timeout_s)
        try:
            yield cluster
        finally:
            cluster.stop()


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


def device_params(devices: Devices | None) -> dict:
    """A pinned node's configuration fields: its devices, and torch threads to match."""
    if devices is None:
        return {}
    threads = {} if devices.threads is None else {"threads": devices.threads}
    return {"devices": str(devices), **threads}


@dataclass
class HelperProcess:
    """A cluster process that is not a tritonserver (the controller, the OpenAI API), its
    output in ``log_path`` (:func:`orchestrator.cluster.watchdog.start_module`)."""

    log_path: Path
    process: subprocess.Popen | None = None

    def spawn(self, args: list[str], what: str, ready, timeout_s: float) -> None:
        """Start ``python -m args`` and wait until ``ready(lines logged since)`` is true."""
        # Started again: only this run's lines count.
        seen = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.process = start_module(args, self.log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the {what} exited with {self.process.returncode}; "
                                  f"log {self.log_path}")
            if ready(self.log_path.read_bytes()[seen:].decode(errors="replace")):
                return
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"the {what} was not ready within {timeout_s:.0f} s; "
                          f"log {self.log_path}")

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process.pid], timeout_s=5.0)
            self.process.wait(timeout=5)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


@dataclass
class Controller(HelperProcess):
    """The fault controller's process (``python -m orchestrator.fault.controller``)."""

    port: int = 0
    timeout_s: float = 5.0
    secret_file: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def described(cls, state: dict) -> Controller:
        """The controller a cluster's state file describes (to start it again)."""
        c = state["controller"]
        return cls(Path(c["log"]), port=int(c["address"].rsplit(":", 1)[1]),
                   timeout_s=float(c["timeout_s"]), secret_file=Path(state["secret_file"]))

    def start(self, timeout_s: float = 30.0) -> None:
        listening = f"controller listening on {self.address}"
        self.spawn(["orchestrator.fault.controller", "--port", str(self.port), "--timeout-s",
                    str(self.timeout_s), "--secret-file", str(self.secret_file)],
                   "controller", lambda logged: listening in logged, timeout_s)

    def describe(self) -> dict:
        return {"address": self.address, "pid": self.pid, "timeout_s": self.timeout_s,
                "log": str(self.log_path)}


@dataclass
class OpenAIApi(HelperProcess):
    """The OpenAI-compatible API's process (``python -m orchestrator.serving.openai_server``)."""

    port: int = 0
    grpc_url: str = ""  # the frontends', comma-separated
    model_dir: Path | None = None  # its tokenizer

    @classmethod
    def described(cls, state: dict) -> OpenAIApi:
        """The OpenAI API a cluster's state file describes (to start it again)."""
        api = state["openai"]
        return cls(Path(api["log"]), port=int(api["url"].split(":")[2].split("/")[0]),
                   grpc_url=",".join(f["grpc"] for f in state["frontends"]),
                   model_dir=Path(state["model_dir"]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def arguments(self) -> list[str]:
        return ["orchestrator.serving.openai_server", "--grpc-url", self.grpc_url,
                "--model-dir", str(self.model_dir), "--port", str(self.port)]

    def start(self, timeout_s: float = 60.0) -> None:
        self.spawn(self.arguments(), "OpenAI API", lambda _: self.answers(), timeout_s)

    def start_standby(self, fifo: Path) -> subprocess.Popen:
        """A warm spare on this port: it loads, then serves once ``fifo`` is opened for
        writing (:func:`promote_standby`); not waited for."""
        return start_module([*self.arguments(), "--standby", str(fifo)], self.log_path)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/models", timeout=1):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def describe(self) -> dict:
        return {"url": self.url, "pid": self.pid, "log": str(self.log_path)}


def promote_standby(fifo: Path) -> bool:
    """Tell the OpenAI API's warm spare waiting on ``fifo`` to serve; False if none waits
    (still loading, or gone)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader
        return False
    try:
        os.write(fd, b"\n")
    finally:
        os.close(fd)
    return True


def connect_pipeline(call: Call, urls: list[str], replicate: bool = False) -> None:
    """Wire the stages of one token pipeline (gRPC urls, stage 0 first; with ``replicate``
    each one's KV replicas to the next), then start them; ``call(url, op, args)``: a
    control request (:class:`orchestrator.control.client.ControlClient`)."""
    try:
        endpoints = [call(url, "endpoints", []) for url in urls]
        for i, url in enumerate(urls):
            call(url, "connect", [endpoints[(i + 1) % len(urls)], endpoints[0]])
        if replicate:
            replicas = [call(url, "replica_endpoints", []) for url in urls]
            for i, url in enumerate(urls):
                call(url, "replicate", [replicas[(i + 1) % len(urls)], replicas[i - 1]])
        for url in [*urls[1:], urls[0]]:  # the head last: it starts counting heartbeats
            call(url, "start", [])
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


def _running(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | None:
    """``parser``'s arguments and ``--dir``; None, said on stderr, if no cluster runs there."""
    _dir_argument(parser)
    args = parser.parse_args(argv)
    try:
        read_state(args.dir)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return None
    return args


def topology_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``dejavu up`` and ``dejavu repo`` share: one cluster, two ways to deploy."""
    parser.add_argument("--prefill", type=int, default=1, help="number of P-pipelines")
    parser.add_argument("--decode", type=int, default=1, help="number of T-pipelines")
    parser.add_argument("--prefill-depth", type=int, default=1,
                        help="prompt stages per P-node (D_p, in one process)")
    parser.add_argument("--decode-depth", type=int, default=1,
                        help="T-nodes per token pipeline (D_t, one stage each)")
    parser.add_argument("--colocated", action="store_true",
                        help="no P-nodes: token pipelines prefill their own prompts")
    parser.add_argument("--swap", choices=list(SwapMode), default=SwapMode.OFF,
                        help="microbatch swapping on the T-stages")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences per microbatch")
    parser.add_argument("--max-seq-len", type=int, help="KV slot size (default: model's)")
    parser.add_argument("--engine", choices=["torch", "emulated"], default="torch",
                        help="torch: the model's real compute (default); emulated: each step "
                        "sleeps --profile's time, tokens are a hash of the sequence, KV is "
                        "real bytes in the model's layout")
    parser.add_argument("--profile", default="",
                        help="engine profile for --engine emulated: a file, or a shipped "
                        "name (e.g. splitwise-llama2-70b-h100)")
    parser.add_argument("--trtllm-api", choices=list(TrtllmApi), default=TrtllmApi.LEGACY,
                        help="what the frontend serves as tensorrt_llm (both name their "
                        "model so): legacy, the TensorRT-LLM backend's token model "
                        "(default); llmapi, TensorRT-LLM's LLM-API model (text in, "
                        "sampling_param_*, its llmapi_client.py). ensemble, "
                        "tensorrt_llm_bls and the OpenAI API are served either way")
    parser.add_argument("--trtllm-decoupled", choices=["true", "false"],
                        help="the tensorrt_llm model's transaction policy, the TensorRT-LLM "
                        "backend's decoupled_mode (default: legacy true, llmapi false, as "
                        "its model.yaml): true streams; false serves a unary ModelInfer "
                        "(one response), refusing streaming (and batches) as they do")
    parser.add_argument("--frontends", type=int, default=1, metavar="N",
                        help="frontend nodes: N tritonservers clients reach, each serving every "
                        "model and routing to the shared P and T pools (frontend, frontend1, "
                        "...); one lost, the others serve on (docs/fault-tolerance.md)")
    parser.add_argument("--frontend-instances", type=int, default=1, metavar="N",
                        help="processes of the orchestrator model inside each frontend's "
                        "tritonserver (the ensemble's token path), requests spread across "
                        "them: one carries ~3,000 tokens/s (docs/bench-serving.md); they share "
                        "its ports and fall with it, unlike --frontends")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="N",
                        help="tokens per streamed response after the first (the ensemble's "
                        "stream, OpenAI streams): fewer responses, less CPU per token")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                        help="--engine emulated: every step sleeps the profile's time x K "
                        "(a K-times slower replay, so the serving path's own CPU stays small "
                        "against the engine's time; divide measured times by K)")
    parser.add_argument("--prefix-cache-mb", type=float, default=256.0, metavar="MIB",
                        help="every node that prefills (P-nodes; colocated: the token "
                        "pipelines) keeps this much prompt KV to reuse for prompts that share "
                        "a prefix (host memory on CPU, device memory on a GPU); 0: off")
    parser.add_argument("--decode-cache-mb", type=float, default=0.0, metavar="MIB",
                        help="disaggregated T-nodes (--decode-depth 1) keep this much of "
                        "finished requests' KV (prompt and answer): a conversation's next turn "
                        "routed back receives only the blocks they lack from its P-node "
                        "(decode-side reuse; --router kv routes it back); 0: off")
    parser.add_argument("--kv-block", type=int, default=32, metavar="TOKENS",
                        help="tokens per prefix-cache block (a prompt reuses whole blocks)")
    parser.add_argument("--router", choices=["jsq", "kv", "round-robin"], default="jsq",
                        help="the frontend's routing: jsq (fewest pending tokens), kv (a "
                        "prompt to the node that prefills it (P-node; colocated: token "
                        "pipeline) whose prefix cache holds most of it, by the nodes' KV "
                        "events), round-robin")
    parser.add_argument("--kv-weight", type=float, default=DEFAULT_KV_WEIGHT,
                        help="--router kv: weight of a prompt's tokens to compute against a "
                        "node's pending tokens (default %(default)s)")
    parser.add_argument("--prefill-chunk", type=int, default=0, metavar="TOKENS",
                        help="--colocated: each step carries the running sequences' token "
                        "steps plus prompt chunks up to this many tokens (chunked prefill, "
                        "Sarathi-Serve's stall-free batching); 0: whole prompts (default)")
    parser.add_argument("--replicate", choices=list(ReplicateMode), default=ReplicateMode.ON,
                        help="T-stages stream KV replicas to the next stage (disk: to local "
                        "disk); a lost stage is started again and resumes from them "
                        "(pipelines deeper than 1)")


def topology_from(args: argparse.Namespace) -> Topology:
    """The cluster :func:`topology_arguments` parsed."""
    return Topology(args.prefill, args.decode, args.prefill_depth, args.decode_depth,
                    args.colocated, frontends=args.frontends)


def settings_from(args: argparse.Namespace) -> dict:
    """The node settings :func:`topology_arguments` parsed, as NodeConfig fields."""
    return {"max_seq_len": args.max_seq_len, "swap": args.swap, "replicate": args.replicate,
            "max_batch": args.max_batch, "profile": engine_profile(args.engine, args.profile),
            "trtllm_api": args.trtllm_api,
            "trtllm_decoupled": (None if args.trtllm_decoupled is None
                                 else args.trtllm_decoupled == "true"),
            "time_scale": args.time_scale, "frontend_instances": args.frontend_instances,
            "stream_interval": args.stream_interval,
            "prefix_cache_mb": args.prefix_cache_mb, "kv_block": args.kv_block,
            "decode_cache_mb": args.decode_cache_mb,
            "router": args.router, "kv_weight": args.kv_weight,
            "prefill_chunk": args.prefill_chunk}


def engine_profile(engine: str, profile: str) -> str:
    """The nodes' ``profile`` field for ``--engine``/``--profile``, checked before any node
    starts: a file's absolute path (nodes run elsewhere), a shipped name as it is."""
    if (engine == "emulated") != bool(profile):
        raise ValueError("--engine emulated needs --profile, and --profile needs it")
    if not profile:
        return ""
    from orchestrator.profiles.profile import load_profile

    load_profile(profile)  # a clear error now rather than in every node's log
    return str(Path(profile).resolve()) if Path(profile).exists() else profile


def up_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu up", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (config.json, weights)")
    parser.add_argument("--spec", type=Path, help="a planner cluster spec (JSON): its model, "
                        "mode and pipelines replace --model, --prefill, --decode, the depths")
    topology_arguments(parser)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for ready")
    parser.add_argument("--controller-timeout", type=float, default=DEAD_AFTER_S,
                        help="the fault controller declares a node silent this long dead")
    parser.add_argument("--devices", nargs="+", default=[], metavar="NODE=DEVICES",
                        help="pin nodes to devices, e.g. prefill0=cpu:0 decode0=cpu:1 "
                        "(cores; cuda:0 sets CUDA_VISIBLE_DEVICES); replaces the spec's")
    parser.add_argument("--spares", type=int, default=0,
                        help="warm spare T-nodes (loaded, on standby): a lost stage's role "
                        "moves to one instead of waiting for its process to start again")
    parser.add_argument("--prefill-spares", type=int, default=0,
                        help="warm spare P-nodes (loaded, on standby): a lost P-node's role "
                        "moves to one instead of waiting for its process to start again")
    _dir_argument(parser)
    args = parser.parse_args(argv)
    if (Path(args.dir) / STATE_FILE).exists():
        if any(is_ready(n["http"]) for n in read_state(args.dir)["nodes"]):
            print(f"a cluster is up in {args.dir}: run `dejavu down` first", file=sys.stderr)
            return 1
        (Path(args.dir) / STATE_FILE).unlink()  # left by a cluster that died
    try:
        common = dict(run_dir=args.dir, controller_timeout_s=args.controller_timeout,
                      devices=parse_assignments(args.devices), spares=args.spares,
                      prefill_spares=args.prefill_spares, frontends=args.frontends,
                      **settings_from(args))
        if args.spec is not None:
            del common["max_batch"]  # the spec's
            cluster = Cluster.from_spec(json.loads(args.spec.read_text()), **common)
        elif args.model is None:
            raise ValueError("give --model DIR or --spec FILE")
        else:
            t = topology_from(args)
            cluster = Cluster(args.model, t.prefill, t.decode, t.colocated,
                              prefill_depth=t.prefill_depth, decode_depth=t.decode_depth,
                              **common)
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
    if cluster.openai is not None:
        print(f"{'openai':<10} {'api':<9} {'':<14} {'':<10} {cluster.openai.url}  "
              f"log {cluster.openai.log_path}")
    print(f"ready: ensemble at {', '.join(f'http://{s.http_url}' for s in cluster.frontends)} "
          f"(state in {args.dir})")
    if args.time_scale != 1.0:
        print(f"time scale K = {args.time_scale:g}: every engine step sleeps its profile time "
              f"x {args.time_scale:g}; divide measured times by K, multiply rates by K")
    return 0


def _place(node: dict) -> str:
    """Where a node sits: ``pipeline 0 stage 1/3`` (P-nodes: ``pipeline 0 depth 2``)."""
    if Role(node["role"]).spare:
        return f"standby (depth {node['depth']})"
    if node.get("pipeline") is None:
        return ""
    if node.get("stage") is None:
        return f"pipeline {node['pipeline']} depth {node['depth']}"
    return f"pipeline {node['pipeline']} stage {node['stage']}/{node['depth']}"


def _devices(node: dict) -> str:
    return node.get("devices") or "any"


def status_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dejavu status", description="show the local cluster; exit 1 when a role that "
        "serves is down or the controller does not answer (a spare down is a warning)")
    parser.add_argument("--json", action="store_true", help="print the state as JSON")
    args = _running(parser, argv)
    if args is None:
        return 1
    state = read_state(args.dir)
    for node in state["nodes"]:
        node["ready"] = is_ready(node["http"])
    view = controller_view(state)
    state["warnings"] = [f"{n['name']} DOWN: the spare pool is short one warm spare (a used "
                         f"spare's replacement loading); every role still serves"
                         for n in state["nodes"] if Role(n["role"]).spare and not n["ready"]]
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
        for role, does in [("supervisor", "starts lost processes again"),
                           ("watchdog", "starts the supervisor again")]:
            pid = read_pid(Path(args.dir), role)
            print(f"{role} pid {pid}: {does if pid and alive(pid) else 'GONE'}")
        api = state.get("openai")
        if api:
            print(f"OpenAI API {api['url']} pid {api['pid']}: "
                  f"{'serving' if alive(api['pid']) else 'GONE'}")
        for warning in state["warnings"]:
            print(f"warning: {warning}")
    return 0 if serving(state, view) else 1


def serving(state: dict, view: dict) -> bool:
    """Every role that serves is up (a spare is not one: a degraded spare pool is a
    warning) and the controller answers and counts each registered node alive."""
    return "error" not in view and all(
        n["ready"] and n["controller"] in ("alive", "-")
        for n in state["nodes"] if not Role(n["role"]).spare)


def controller_view(state: dict) -> dict:
    """Ask the controller; mark each node of ``state`` alive, dead or unregistered in its
    view (``-``: the frontend does not register) and keep the answer in ``state``."""
    import grpc  # only where needed

    from orchestrator.fault.client import query_status

    controller = state.get("controller") or {}
    try:
        view = query_status(controller["address"], load_secret(state["secret_file"]))
    except KeyError:
        view = {"error": "none recorded in the state file"}
    except grpc.RpcError as exc:
        view = {"error": f"unreachable ({exc.code().name})"}
    controller["view"] = view
    registered = {n["address"]: n for n in view.get("nodes", [])}  # the latest per address
    for node in state["nodes"]:
        known = registered.get(node["grpc"])
        if node["role"] == Role.FRONTEND or Role(node["role"]).spare:  # a spare: once it serves
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
    args = _running(parser, argv)
    if args is None:
        return 1
    for what in stop_described(args.dir):
        print(f"stopped {what}")
    (Path(args.dir) / STATE_FILE).unlink(missing_ok=True)
    return 0


def stop_described(run_dir: str | Path) -> list[str]:
    """Stop the processes of a cluster's state file: the supervisor first (it would start
    nodes again), every node (read again: the supervisor may have just started one), then
    the controller. What was stopped, in that order."""
    stopped = []
    run_dir = Path(run_dir)
    read_state(run_dir)  # none: FileNotFoundError
    (run_dir / STOPPING).touch()  # neither keeper starts anything from now on
    for role in ("watchdog", "supervisor"):
        pid = read_pid(run_dir, role)
        if pid is not None and alive(pid):
            stop_processes([pid], timeout_s=5.0)
            stopped.append(f"the {role}")
    state = read_state(run_dir)
    stop_processes([node["pid"] for node in state["nodes"] if node["pid"]])
    namespace = ShmNamespace.from_state(state)
    for node in state["nodes"]:
        clean_shm(node["shm_prefix"], namespace)
        stopped.append(node["name"])
    if namespace is not None:
        stop_namespace(namespace)
        stopped.append("the namespace holder")
    if (state.get("controller") or {}).get("pid"):
        stop_processes([state["controller"]["pid"]], timeout_s=5.0)
        stopped.append("the controller")
    api = state.get("openai") or {}
    if api.get("pid"):
        stop_processes([api["pid"], *([api["standby_pid"]] if api.get("standby_pid") else [])],
                       timeout_s=5.0)
        stopped.append("the OpenAI API")
    return stopped
