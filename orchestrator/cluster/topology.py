"""The nodes of a cluster and their configurations: the one writer every deployment uses.

``dejavu up`` (and its planner-spec form) puts the nodes on loopback ports,
``dejavu repo`` inside containers on service names (docker-compose, Kubernetes):
both call :func:`node_configs` with the same :class:`Topology` and settings,
and differ only in how a node's name becomes its address.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.cluster.tritonserver import add_model
from orchestrator.pipeline import prompt_slots
from orchestrator.serving.config import Mode, NodeConfig, Role, TrtllmApi

# The folder served as tensorrt_llm under --trtllm-api llmapi (TensorRT-LLM's LLM-API model).
LLMAPI_MODEL = "tensorrt_llm_llmapi"
ROLE_MODELS = {
    Role.FRONTEND: ("preprocessing", "orchestrator", "ensemble", "tensorrt_llm_bls", "tensorrt_llm",
                    "postprocessing"),
    Role.PREFILL: ("prefill",),
    Role.DECODE: ("decode",),
    Role.SPARE: ("decode",),
    Role.PREFILL_SPARE: ("prefill",),
}


@dataclass(frozen=True)
class Topology:
    """``prefill``/``decode``: how many P- and T-pipelines, of depths ``prefill_depth``
    (prompt stages in one P-node) and ``decode_depth`` (T-nodes, one stage each);
    ``spares``: warm spare T-nodes that take over a lost stage; ``frontends``: frontend
    nodes (tritonservers clients reach), each routing to every pool on its own;
    ``prefill_spares``: warm spare P-nodes that take over a lost P-node."""

    prefill: int = 1
    decode: int = 1
    prefill_depth: int = 1
    decode_depth: int = 1
    colocated: bool = False
    spares: int = 0
    frontends: int = 1
    prefill_spares: int = 0

    def __post_init__(self) -> None:
        if self.frontends < 1:
            raise ValueError(f"a cluster needs at least one frontend, got {self.frontends}")
        if self.spares < 0 or self.spares and self.decode_depth < 2:
            raise ValueError(f"spares take over stages of pipelines deeper than 1; got "
                             f"{self.spares} spares at depth {self.decode_depth}")
        if self.prefill_spares < 0 or self.prefill_spares and self.colocated:
            raise ValueError(f"P spares take over P-nodes, which a colocated cluster does not "
                             f"have; got {self.prefill_spares} P spares")
        if self.decode < 1:
            raise ValueError("a cluster needs at least one decode node")
        if not self.colocated and self.prefill < 1:
            raise ValueError("disaggregated mode needs at least one prefill node")
        if self.prefill_depth < 1 or self.decode_depth < 1:
            raise ValueError(f"depths must be >= 1, got prefill {self.prefill_depth}, "
                             f"decode {self.decode_depth}")

    @classmethod
    def from_spec(cls, spec: dict) -> tuple[Topology, dict]:
        """A planner cluster spec's topology, and the settings it fixes (model_dir, batch)."""
        version = spec.get("version")
        if version != 1:
            raise ValueError(f"cluster spec version {version!r}: only version 1 is known")
        mode, prefill, decode = spec.get("mode"), spec.get("prefill"), spec.get("decode")
        if mode not in tuple(Mode) or not isinstance(decode, dict):
            raise ValueError("a cluster spec needs mode (disaggregated | colocated) and "
                             "decode {pipelines, depth}")
        if mode == Mode.DISAGGREGATED and not isinstance(prefill, dict):
            raise ValueError("a disaggregated cluster spec needs prefill {pipelines, depth}")
        prefill = prefill or {"pipelines": 0, "depth": 1}
        topology = cls(int(prefill["pipelines"]), int(decode["pipelines"]),
                       int(prefill["depth"]), int(decode["depth"]), mode == Mode.COLOCATED)
        settings = {"model_dir": spec["model_dir"]}
        if spec.get("batch"):
            settings["max_batch"] = int(spec["batch"])
        return topology, settings

    def prefill_names(self) -> list[str]:
        return [] if self.colocated else [f"prefill{p}" for p in range(self.prefill)]

    def frontend_names(self) -> list[str]:
        """``frontend``, then ``frontend1``, ``frontend2``...: the first keeps its name."""
        return ["frontend", *(f"frontend{i}" for i in range(1, self.frontends))]

    def decode_names(self) -> list[list[str]]:
        """Each token pipeline's node names, stage 0 first."""
        return [[decode_name(p, i, self.decode_depth) for i in range(self.decode_depth)]
                for p in range(self.decode)]


def decode_name(pipeline: int, stage: int, depth: int) -> str:
    return f"decode{pipeline}" if depth == 1 else f"decode{pipeline}s{stage}"


def node_configs(topology: Topology, address: Callable[[str], str],
                 replica_dir: Callable[[str], str] = lambda name: "",
                 prefill_profile: str = "", **settings) -> dict[str, NodeConfig]:
    """Every node's configuration, by name, the frontends last (the same but for the name:
    none of them is addressed by another node). ``address``: a node's gRPC url
    from its name; ``replica_dir``: where it keeps replicas on disk; ``prefill_profile``:
    the P-nodes' emulated engine profile where they are other machines than the rest
    (Splitwise's mixed pools, e.g. H100 prompt machines and A100 token machines);
    ``settings``: the :class:`NodeConfig` fields that are the same on every node
    (model_dir, swap, profile, ...)."""
    mode = Mode.COLOCATED if topology.colocated else Mode.DISAGGREGATED
    prefill, decode = topology.prefill_names(), topology.decode_names()
    if settings.get("num_slots") is None and prefill:
        settings["num_slots"] = prompt_slots(len(prefill), len(decode))
    shared = dict(settings, mode=mode, prefill_depth=topology.prefill_depth,
                  prefill_urls=tuple(address(n) for n in prefill),
                  decode_urls=tuple(tuple(address(n) for n in stages) for stages in decode))

    def config(name: str, role: Role, **place) -> NodeConfig:
        return NodeConfig(role=role, name=name, address=address(name),
                          replica_dir=replica_dir(name), **place, **shared)

    if prefill_profile and not settings.get("profile"):
        raise ValueError("a P-node profile needs one for the other nodes too: the emulated "
                         "engine on every node")
    prefill_own = {"profile": prefill_profile} if prefill_profile else {}
    configs = {name: replace(config(name, Role.PREFILL, pipeline=p), **prefill_own)
               for p, name in enumerate(prefill)}
    for p, stages in enumerate(decode):
        for i, name in enumerate(stages):
            configs[name] = config(name, Role.DECODE, pipeline=p, stage=i, depth=len(stages))
    for i in range(topology.spares):
        configs[f"spare{i}"] = config(f"spare{i}", Role.SPARE, depth=topology.decode_depth)
    for i in range(topology.prefill_spares):  # the P-nodes' engine, as theirs
        configs[f"pspare{i}"] = replace(config(f"pspare{i}", Role.PREFILL_SPARE), **prefill_own)
    for name in topology.frontend_names():
        configs[name] = config(name, Role.FRONTEND)
    return configs


def write_node_repo(repo: Path, config: NodeConfig) -> None:
    """The model repository of one node: each of its role's models gets the config."""
    for model in ROLE_MODELS[config.role]:
        trtllm = model == "tensorrt_llm"
        add_model(repo, model, {"config": config.to_json()} if model != "ensemble" else None,
                  decoupled=config.tensorrt_llm_decoupled or not trtllm,
                  source=LLMAPI_MODEL if trtllm and config.trtllm_api is TrtllmApi.LLMAPI
                  else model,
                  instances=config.frontend_instances if model == "orchestrator" else 1)
