"""``dejavu bench serving --breakdown``: where one token's time goes, at concurrency 1.

Each layer of the per-token path is measured on its own, interleaved round
robin so the machine's noise hits them alike, as the median over requests of a
request's time per token after its first (a stream that falls behind gets
several tokens in one response):

- ``engine``: the bare engine's decode step (``TorchEngine.decode`` + sampling);
- ``pipeline``: a depth-1 colocated :class:`LocalPipeline` in this process (the
  serving nodes' head, scheduler and stage thread over the in-process transport);
- ``T-node``: the decode model of a tritonserver, called as the frontend calls
  it (a :class:`~orchestrator.serving.node_stream.NodeStream` and its token
  feed: the token service, its feed messages, Triton's Python-backend IPC and
  gRPC for each request's own responses); colocated only (a T-node of a 1P+1T
  cluster takes its prompts' KV from the P-node the frontend drives);
- ``frontend``: the orchestrator model of the frontend (its stream to the
  T-node, the relay thread, IPC again, gRPC again);
- ``ensemble``: what clients call (the ensemble's scheduling, preprocessing, and
  the orchestrator model's detokenization per token).

Each layer's cost is its time minus the layer inside it. Then the CPU time
every process of the cluster (and this one, the client) spends per streamed
token of the ``ensemble`` layer, from ``/proc``: on a machine with fewer cores
than busy processes, the sum of these sets the gap between tokens. The cluster is
colocated (1 T-node) or 1P+1T: after the first token a disaggregated request runs
the same code, beside the T-node's prompt-KV transport. In the same run one
stage-to-stage hop (a message from a :class:`TransportSender` to a
:class:`TransportReceiver` over NIXL, as between two T-stages) is timed against
NIXL's own small-message round trip (one WRITE with a notification, polled without
sleeping), both as ping-pong between two agents in this process.
"""

from __future__ import annotations

import json
import os
import queue
import re
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from clients.common import Machines, on_machine
from orchestrator.cluster.devices import Devices
from orchestrator.cluster.tritonserver import proc_stat

LAYERS = ("engine", "pipeline", "T-node", "frontend", "ensemble")
COSTS = {  # what each layer adds over the one inside it
    "engine": "engine decode step + sampling",
    "pipeline": "head + scheduler + links + stage thread",
    "T-node": "token service + Triton Python-backend IPC + gRPC",
    "frontend": "frontend relay (gRPC client, relay thread, IPC, gRPC)",
    "ensemble": "ensemble + detokenize",
}


@dataclass
class Layer:
    name: str
    ms_per_token: float  # median over the runs of a run's time per token after its first
    adds_ms: float  # over the layer inside it
    adds: str


# One request as its client saw it: (arrival time, tokens in that response), the first
# entry (start, 0).
Arrivals = list[tuple[float, int]]


def ms_per_token(arrivals: Arrivals) -> float | None:
    """The request's time per token after its first response (None: none came after it,
    all its tokens fell behind into the first)."""
    (first, head), (last, _) = arrivals[1], arrivals[-1]
    after = sum(n for _, n in arrivals) - head
    return (last - first) * 1e3 / after if after else None


def time_engine(engine, prompt_ids: list[int], tokens: int) -> Arrivals:
    from orchestrator.engine.sampling import Sampler

    sampler, cache = Sampler(None), engine.new_cache()
    h = engine.prefill([torch.tensor(prompt_ids)], [cache])
    token, arrivals = int(sampler(torch.stack(h))[0]), [(0.0, 0), (time.perf_counter(), 1)]
    for _ in range(tokens - 1):
        logits = engine.decode(torch.tensor([token]), [cache])
        token = int(sampler(logits)[0])
        arrivals.append((time.perf_counter(), 1))
    return arrivals


def time_pipeline(pipeline, prompt_ids: list[int], tokens: int, timeout_s: float = 60.0
                  ) -> Arrivals:
    from orchestrator.pipeline.sequence import Sequence

    arrivals: Arrivals = [(0.0, 0)]
    done = queue.Queue()

    def on_token(seq, token, finished) -> None:
        arrivals.append((time.perf_counter(), 1))
        if finished:
            done.put(seq)

    pipeline.submit(Sequence(f"breakdown-{time.monotonic_ns()}", prompt_ids, tokens,
                             on_token=on_token))
    done.get(timeout=timeout_s)
    return arrivals


def signed_request(secret: bytes, prompt_ids: list[int], params) -> dict:
    """What a request straight to the frontend's ``orchestrator`` model carries: the
    ensemble's batched ``[1, ...]`` tensors and preprocessing's signature of the prompt
    ids (as the ensemble hands it on)."""
    from orchestrator.control.auth import sign_prompt
    from orchestrator.control.client import tensor

    ids = np.array([prompt_ids], dtype=np.int32)
    arrays = {"input_ids": ids, "input_lengths": np.array([[len(prompt_ids)]], np.int32),
              "input_auth": np.array([[sign_prompt(secret, ids.tobytes()).encode()]],
                                     dtype=np.object_),
              "max_tokens": np.array([[params.max_tokens]], np.int32),
              "stream": np.array([[params.stream]])}
    return {"inputs": [tensor(name, array) for name, array in arrays.items()]}


def stream_orchestrator(url: str, secret: bytes, prompt_ids: list[int], max_tokens: int
                        ) -> Iterator[list[int]]:
    """Token ids straight from the frontend's ``orchestrator`` model, one response at a time
    (signed as preprocessing signs them); closing the generator early cancels the request,
    which frees its T-node at once."""
    from clients.generate import stream_results
    from orchestrator.serving.params import GenerationParams

    params = GenerationParams(max_tokens=max_tokens, stream=True)
    request = signed_request(secret, prompt_ids, params)
    for result in stream_results(url, "orchestrator", request["inputs"]):
        yield result.as_numpy("output_ids").reshape(-1).tolist()


def time_stream(url: str, model: str, request: dict, timeout_s: float = 60.0) -> Arrivals:
    """When a streamed request's responses that carry tokens arrive (as a client's consumer
    thread sees them), and how many each holds; ``request``: :func:`signed_request`'s."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    arrivals: Arrivals = [(time.perf_counter(), 0)]
    try:
        client.async_stream_infer(model, enable_empty_final_response=True, **request)
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise RuntimeError(f"{model} at {url}: {error}")
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                arrivals.append((time.perf_counter(), ids.size))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return arrivals
    finally:
        client.stop_stream()
        client.close()


def time_node_stream(stream, prompt_ids: list[int], params, timeout_s: float = 60.0
                     ) -> Arrivals:
    """A T-node's tokens as the frontend gets them: a request on its ``NodeStream``."""
    from orchestrator.serving.frontend import request_arrays

    request = stream.open(uuid.uuid4().hex, timeout_s)
    arrivals: Arrivals = [(time.perf_counter(), 0)]
    try:
        request.send(request_arrays(prompt_ids, params))
        done = False
        while not done:
            tokens, _, done = request.tokens(lambda: False)
            if tokens:
                arrivals.append((time.perf_counter(), len(tokens)))
        return arrivals
    finally:
        request.close()


def measure_layers(runs: dict[str, Callable[[], Arrivals]], repeats: int
                   ) -> tuple[list[Layer], list[float]]:
    """Each run ``repeats`` times, round robin; a layer's figure is the median of its runs'
    times per token. Also each round's outermost layer over its innermost (served / bare
    in the same ~0.2 s: this machine's speed drifts over seconds)."""
    figures: dict[str, list[float | None]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for name, run in runs.items():
            figures[name].append(ms_per_token(run()))
    layers, inner, below = [], 0.0, -1
    for name in runs:
        timed = [x for x in figures[name] if x is not None]
        if not timed:
            raise RuntimeError(f"{name}: every request's tokens came in one response")
        ms = statistics.median(timed)
        at = LAYERS.index(name)  # a layer left out: what it adds counts in the next one's
        adds = " + ".join(COSTS[x] for x in LAYERS[below + 1 : at + 1])
        layers.append(Layer(name, ms, ms - inner, adds))
        inner, below = ms, at
    first, last = figures[next(iter(runs))], figures[list(runs)[-1]]
    rounds = [out / bare for bare, out in zip(first, last, strict=True) if bare and out]
    return layers, rounds


# -- CPU per token, by process ------------------------------------------------------------


@dataclass
class ProcessCpu:
    process: str  # a tritonserver (by model repository), a model's stub, or a python module
    us_per_token: float


def _children() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(proc_stat(int(entry))[1])
            except (OSError, IndexError):
                continue
            found.setdefault(parent, []).append(int(entry))
    return found


def _cpu_s(pid: int) -> float:
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _label(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    command = " ".join(argv)
    if stub := re.search(r"repos/([^/]+)/([^/]+)/\d+/model\.py", command):
        return f"{stub.group(1)} {stub.group(2)} (Python stub)"
    if repo := re.search(r"--model-repository=\S*/repos/(\S+)", command):
        return f"{repo.group(1)} tritonserver"
    if "-m" in argv:
        module = argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
        if module == "service_process":  # a T-node's: named after its stub's node
            return f"{_label(int(proc_stat(pid)[1])).split()[0]} token service"
        return module
    return "client" if pid == os.getpid() else os.path.basename(argv[0])


def cpu_per_token(run: Callable[[], Arrivals], requests: int, min_s: float = 3.0
                  ) -> list[ProcessCpu]:
    """Each process's CPU time (this one and every one below it) per token of ``run``'s
    responses over ``requests`` runs and at least ``min_s`` (the kernel counts CPU time in
    10 ms ticks), the busiest first."""
    tree, stack, children = [], [os.getpid()], _children()
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack += children.get(pid, [])
    labels, before = {}, {}
    for pid in tree:
        try:
            labels[pid], before[pid] = _label(pid), _cpu_s(pid)
        except OSError:  # ended meanwhile
            continue
    tokens, runs, begin = 0, 0, time.monotonic()
    while runs < requests or time.monotonic() - begin < min_s:
        tokens += sum(n for _, n in run())
        runs += 1
    spent: dict[str, float] = {}
    for pid, label in labels.items():
        try:
            spent[label] = spent.get(label, 0.0) + _cpu_s(pid) - before[pid]
        except OSError:
            continue
    return sorted((ProcessCpu(label, s / tokens * 1e6) for label, s in spent.items() if s > 0),
                  key=lambda p: -p.us_per_token)


# -- the engine's step where it runs -------------------------------------------------------


@dataclass
class Step:
    in_process_ms: float  # median decode step of the in-process pipeline's stage
    in_node_ms: float  # median decode step inside the T-node's token service process

    @property
    def ratio(self) -> float:
        return self.in_node_ms / self.in_process_ms


def decode_step_ms(intervals) -> float:
    """The median length of the decode steps among a stage's busy ``intervals``."""
    steps = [(i.end - i.start) * 1e3 for i in intervals if i.kind == "decode"]
    if not steps:
        raise RuntimeError("the stage ran no decode step")
    return statistics.median(steps)


# -- one stage-to-stage hop against NIXL's own round trip ----------------------------------


@dataclass
class Hop:
    link_rtt_us: float  # TransportLink message there and back, median
    nixl_rtt_us: float  # one small NIXL WRITE + notification there and back, median

    @property
    def ratio(self) -> float:
        return self.link_rtt_us / self.nixl_rtt_us


def measure_hop(rounds: int = 300) -> Hop:
    from orchestrator.kv.transport.base import KVPoll, Region
    from orchestrator.kv.transport.nixl import NixlTransport
    from orchestrator.pipeline.link import TokenMessage
    from orchestrator.pipeline.transport_link import TransportReceiver, TransportSender

    a, b = NixlTransport(), NixlTransport()
    try:
        at_b, at_a = (TransportReceiver(t, slots=4, slot_bytes=1 << 16) for t in (b, a))
        there, back = TransportSender(a, at_b.ticket()), TransportSender(b, at_a.ticket())
        message = TokenMessage(0, 0, {0: 1})

        def link_round() -> None:
            there.send(message, 5.0)
            at_b.recv(5.0)
            back.send(message, 5.0)
            at_a.recv(5.0)

        bufs = {t: torch.zeros(64, dtype=torch.uint8) for t in (a, b)}
        regions = {t: t.register(buf) for t, buf in bufs.items()}
        for src, dst in ((a, b), (b, a)):
            src.add_peer(dst.name, dst.metadata())

        def write(src, dst) -> None:
            handle = src.write(dst.name, [(regions[src], Region(regions[dst].addr, 64))], b"n")
            while src.poll(handle) is KVPoll.TRANSFERRING:
                pass
            while not dst.drain_notifications():
                pass

        def nixl_round() -> None:
            write(a, b)
            write(b, a)

        link_us, nixl_us = _interleaved_medians_us([link_round, nixl_round], rounds)
        return Hop(link_us, nixl_us)
    finally:
        a.close()
        b.close()


def _interleaved_medians_us(runs: list[Callable[[], None]], rounds: int) -> list[float]:
    """Each run's median time, the runs alternating so the machine's noise hits them alike."""
    samples: list[list[float]] = [[] for _ in runs]
    for i in range(rounds + 10):  # the first 10: warm-up
        for run, mine in zip(runs, samples, strict=True):
            begin = time.perf_counter()
            run()
            if i >= 10:
                mine.append(time.perf_counter() - begin)
    return [statistics.median(mine) * 1e6 for mine in samples]


# -- the whole breakdown ------------------------------------------------------------------


def run_breakdown(model_dir, prompt: str, tokens: int, repeats: int, out_dir,
                  machines: Machines | None = None, colocated: bool = True) -> Breakdown:
    """``machines`` (``--pin``): the T-node, the engine and the in-process pipeline on the
    token core, the frontend (and the P-node) and this client on the others."""
    from clients.generate import stream_grpc
    from orchestrator.cluster.launcher import Cluster
    from orchestrator.control.auth import load_secret
    from orchestrator.control.client import ControlClient
    from orchestrator.engine.tokenizer import load_tokenizer
    from orchestrator.engine.torch_engine import load_engine
    from orchestrator.pipeline.local import LocalPipeline
    from orchestrator.pipeline.node import PipelineConfig
    from orchestrator.serving.feed import FeedListener
    from orchestrator.serving.node_stream import NodeStream
    from orchestrator.serving.params import GenerationParams

    torch.set_num_threads(1)  # as a serving node
    prompt_ids = load_tokenizer(model_dir).encode(prompt).ids
    engine = load_engine(model_dir)
    params = GenerationParams(max_tokens=tokens, stream=True)
    hop = measure_hop()  # first: its two agents' progress threads want both cores
    devices, token_core = None, None
    if machines is not None:
        machines.host.pin()
        devices = {"decode0": machines.token, "frontend": machines.host}
        if not colocated:
            devices["prefill0"] = machines.host
        token_core = machines.token
    with on_machine(token_core):  # its threads stay there
        pipeline = LocalPipeline([engine], PipelineConfig(1, 1, mode="colocated")).start()
    try:
        with Cluster.up(model_dir, colocated=colocated, run_dir=out_dir / "cluster",
                        devices=devices) as cluster:
            tnode = cluster.role("decode")[0].server.grpc_url
            frontend = cluster.frontend.grpc_url
            secret = load_secret(cluster.secret_file)

            listener = FeedListener(secret)
            node = NodeStream(tnode, secret, listener)
            runs = {
                "engine": lambda: _on(token_core, time_engine, engine, prompt_ids, tokens),
                "pipeline": lambda: time_pipeline(pipeline, prompt_ids, tokens),
                "T-node": lambda: time_node_stream(node, prompt_ids, params),
                "frontend": lambda: time_stream(frontend, "orchestrator",
                                                signed_request(secret, prompt_ids, params)),
                "ensemble": lambda: _ensemble_times(stream_grpc, frontend, prompt, tokens),
            }
            if not colocated:
                del runs["T-node"]
            try:
                layers, rounds = measure_layers(runs, repeats)
                cpu = cpu_per_token(runs["ensemble"], repeats)
            finally:
                node.close()
                listener.close()
            in_node = json.loads(ControlClient(secret, 30.0).call(tnode, "steps"))
            step = Step(decode_step_ms(pipeline.timelines[0]), in_node["decode"]["median_ms"])
    finally:
        pipeline.stop()
    return Breakdown(layers, rounds, cpu, hop, step)


def _on(machine: Devices | None, run: Callable[..., Arrivals], *args: object) -> Arrivals:
    with on_machine(machine):
        return run(*args)


def _ensemble_times(stream_grpc, url: str, prompt: str, tokens: int) -> Arrivals:
    arrivals: Arrivals = [(time.perf_counter(), 0)]
    for chunk in stream_grpc(url, prompt, max_tokens=tokens, end_id=-1):  # all the tokens
        arrivals.append((time.perf_counter(), len(chunk.ids)))
    return arrivals


@dataclass
class Breakdown:
    layers: list[Layer]
    rounds: list[float]  # served / bare per round
    cpu: list[ProcessCpu]
    hop: Hop
    step: Step

    def report(self, tokens: int, repeats: int) -> str:
        layers, cpu, hop, step = self.layers, self.cpu, self.hop, self.step
        lines = [f"per-token breakdown, concurrency 1, {repeats} requests of {tokens} tokens "
                 "per layer (median of each request's time per token after its first):", "",
                 "| layer | ms/token | adds ms | what it adds |", "|---|---:|---:|---|"]
        lines += [f"| {x.name} | {x.ms_per_token:.3f} | {x.adds_ms:+.3f} | {x.adds} |"
                  for x in layers]
        served, bare = layers[-1].ms_per_token, layers[0].ms_per_token
        lines += ["", "CPU time per token through the ensemble, by process:",
                  "", "| process | CPU us/token |", "|---|---:|"]
        lines += [f"| {p.process} | {p.us_per_token:.0f} |" for p in cpu if p.us_per_token >= 1]
        lines += [f"| **all** | **{sum(p.us_per_token for p in cpu):.0f}** |", ""]
        lines += [f"served (ensemble) / bare engine time per token: {served / bare:.2f} "
                  "(medians)"]
        if self.rounds:
            q = np.quantile(self.rounds, [0.25, 0.5, 0.75])
            lines += [f"served / bare, round by round: median {q[1]:.2f} (quartiles "
                      f"{q[0]:.2f}-{q[2]:.2f}, {len(self.rounds)} rounds)"]
        lines += [f"engine decode step: {step.in_process_ms:.3f} ms in this process, "
                  f"{step.in_node_ms:.3f} ms in the T-node's token service ({step.ratio:.2f}x); "
                  f"served / bare at the node's step: {served / (bare * step.ratio):.2f}",
                  f"stage-to-stage hop: link round trip {hop.link_rtt_us:.0f} us, NIXL's own "
                  f"small-message round trip {hop.nixl_rtt_us:.0f} us: {hop.ratio:.2f}x"]
        return "\n".join(lines)

    def rows(self) -> list[dict]:
        hop, step = self.hop, self.step
        rows = [{"what": x.name, "ms": round(x.ms_per_token, 4), "adds_ms": round(x.adds_ms, 4)}
                for x in self.layers]
        rows += [{"what": f"CPU: {p.process}", "ms": round(p.us_per_token / 1e3, 4),
                  "adds_ms": np.nan} for p in self.cpu]
        rows += [{"what": "link round trip", "ms": hop.link_rtt_us / 1e3, "adds_ms": np.nan},
                 {"what": "nixl round trip", "ms": hop.nixl_rtt_us / 1e3, "adds_ms": np.nan},
                 {"what": "decode step in process", "ms": step.in_process_ms,
                  "adds_ms": np.nan},
                 {"what": "decode step in T-node", "ms": step.in_node_ms, "adds_ms": np.nan}]
        rows += [{"what": f"served / bare, round {i}", "ms": round(r, 4), "adds_ms": np.nan}
                 for i, r in enumerate(self.rounds)]
        return rows
