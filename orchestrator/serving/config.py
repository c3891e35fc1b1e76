"""One node's configuration: a frozen, validated dataclass, one JSON model parameter.

Every deployment path writes it with the same writer
(:func:`orchestrator.cluster.topology.node_configs`: ``dejavu up``, a planner
spec, ``dejavu repo`` for containers); every model of a node reads it once,
from its ``config`` parameter, with :meth:`NodeConfig.from_json`. Unknown keys,
wrong types and impossible combinations are refused there, with the field named.

The cluster secret is not in it: ``secret_file`` names a file holding it (hex),
and without one it comes from the ``DEJAVU_SECRET`` environment variable
(containers), so model repositories and state files carry no secret.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import asdict, dataclass, fields
from enum import Enum, StrEnum

from orchestrator.control.auth import load_secret
from orchestrator.fault import ReplicateMode
from orchestrator.pipeline import (
    DEAD_AFTER_S,
    HEARTBEAT_S,
    PROMPT_SLOTS,
    SwapMode,
    check_prefill_chunk,
)
from orchestrator.serving.router import DEFAULT_KV_WEIGHT, POLICIES


class Role(StrEnum):
    FRONTEND = "frontend"  # the client-facing ensemble and the orchestrator model
    PREFILL = "prefill"  # a P-node
    DECODE = "decode"  # a T-node: one stage of a token pipeline
    SPARE = "spare"  # a warm spare T-node: loaded, on standby (serving/spare.py)
    PREFILL_SPARE = "prefill_spare"  # a warm spare P-node (serving/prefill_role.py)

    @property
    def spare(self) -> bool:
        """A warm spare on standby: it registers with the controller once it takes a role."""
        return self in (Role.SPARE, Role.PREFILL_SPARE)


class TrtllmApi(StrEnum):
    """Which TensorRT-LLM Triton model the frontend serves as ``tensorrt_llm`` (both use
    the name): the legacy backend's token model, or the LLM-API model (text in,
    ``sampling_param_*``: :mod:`orchestrator.serving.llmapi`)."""

    LEGACY = "legacy"
    LLMAPI = "llmapi"


class Mode(StrEnum):
    DISAGGREGATED = "disaggregated"  # P-nodes prefill, KV streams to the T-nodes
    COLOCATED = "colocated"  # the baseline: T-nodes prefill their own prompts


@dataclass(frozen=True)
class NodeConfig:
    """What one node needs to know; the same defaults for every way of deploying it."""

    role: Role
    model_dir: str
    name: str = ""  # its id: KV transport name, controller node id, metrics label
    address: str = ""  # its own gRPC url, as its peers reach it
    controller: str = ""  # the fault controller's address; empty: none
    secret_file: str = ""  # the cluster secret (hex); empty: $DEJAVU_SECRET
    mode: Mode = Mode.DISAGGREGATED
    pipeline: int = 0  # which P- or T-pipeline
    depth: int = 1  # T-node: its pipeline's depth
    stage: int = 0  # T-node: its stage (0: the head)
    prefill_depth: int = 1  # P-node: prompt stages, all in its one process
    max_seq_len: int | None = None  # KV slot size; None: the model's
    profile: str = ""  # an engine profile (file or shipped name): the emulated engine on it
    # (orchestrator/engine/emulated.py); empty: the torch engine
    time_scale: float = 1.0  # the emulated engine sleeps the profile's times x this (a slow
    # replay keeps the serving path's own CPU small against them; figures divide it out)
    max_batch: int = 16  # sequences per microbatch
    num_slots: int | None = None  # prompt KVs held before admission; None: the pipeline's
    reserve_ttl_s: float | None = None  # an unused prompt KV slot is freed after this;
    # None: the pipeline's kv_timeout_s (30 s)
    swap: SwapMode = SwapMode.OFF
    replicate: ReplicateMode = ReplicateMode.ON  # pipelines deeper than 1 only
    replica_dir: str = ""  # replicate=disk: where this node writes its replicas
    heartbeat_s: float = HEARTBEAT_S
    dead_after_s: float = DEAD_AFTER_S  # a stage silent this long is lost
    recover_timeout_s: float = 120.0  # a paused pipeline waits this long for a repair
    devices: str = ""  # cpu:0-1 or cuda:0 (orchestrator.cluster.devices); empty: anywhere
    threads: int = 1  # torch threads: nodes share the machine's cores
    max_requests: int | None = None  # frontend: requests served at once; None: see
    # concurrent_requests
    max_prompt_bytes: int | None = None  # frontend: prompt text limit; None: from the context
    trtllm_api: TrtllmApi = TrtllmApi.LEGACY  # frontend: what its tensorrt_llm model is
    # frontend: tensorrt_llm's model_transaction_policy, the backend's decoupled_mode (false:
    # a unary ModelInfer gets one response; streaming and batches are refused); None: the
    # contract's default (legacy: true; llmapi: false, its model.yaml's)
    trtllm_decoupled: bool | None = None
    # frontend: processes of its ``orchestrator`` model (each its own Frontend, feed and
    # streams; Triton spreads the ensemble's requests across them): one carries ~3,000
    # tokens/s at most
    frontend_instances: int = 1
    stream_interval: int = 1  # frontend: tokens per streamed response after the first
    # Every node that prefills (P-nodes; colocated: the token pipeline's one stage) keeps a
    # prefix cache of this many MiB of prompt KV (host memory on CPU, device memory on a
    # GPU), by blocks of kv_block tokens; 0: none
    prefix_cache_mb: float = 0.0
    kv_block: int = 32
    # Disaggregated T-nodes (token pipelines of depth 1) keep this many MiB of finished
    # requests' KV (prompt and answer, same blocks): a next turn routed back gets only the
    # blocks it lacks from its P-node (decode-side reuse); 0: none
    decode_cache_mb: float = 0.0
    # frontend: how it routes (jsq: by pending tokens; kv: prompts to the prefilling node
    # whose cache holds most of them, kv_weight x tokens to compute + pending tokens;
    # round-robin)
    router: str = "jsq"
    kv_weight: float = DEFAULT_KV_WEIGHT
    # Colocated token pipelines: a step's token budget, its token steps plus prompt chunks
    # (chunked prefill, as Sarathi-Serve's and vLLM's); 0: whole prompts
    prefill_chunk: int = 0
    prefill_urls: tuple[str, ...] = ()  # every P-node's gRPC url
    decode_urls: tuple[tuple[str, ...], ...] = ()  # each token pipeline's, stage 0 first

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name),
                                                     hints[f.name]))
        self._validate()

    def _validate(self) -> None:
        positive = ("depth", "prefill_depth", "max_batch", "threads", "frontend_instances",
                    "stream_interval", "kv_block",
                    "heartbeat_s", "recover_timeout_s", "time_scale")
        for name in (*positive, "max_seq_len", "num_slots", "max_prompt_bytes", "max_requests",
                     "reserve_ttl_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"node config: {name} must be > 0, got {value}")
        if not 0 <= self.stage < self.depth:
            raise ValueError(f"node config: stage {self.stage} is not in a depth-{self.depth} "
                             "pipeline")
        if self.devices.partition(":")[0] not in ("cpu", "cuda") and self.devices:
            raise ValueError(f"node config: devices must be cpu:IDS or cuda:IDS, got "
                             f"{self.devices!r}")
        if self.time_scale != 1.0 and not self.profile:
            raise ValueError("node config: time_scale slows the emulated engine; it needs a "
                             "profile")
        if self.router not in POLICIES:
            raise ValueError(f"node config: router must be one of {', '.join(POLICIES)}, "
                             f"got {self.router!r}")
        if self.kv_weight < 0:
            raise ValueError(f"node config: kv_weight must be >= 0, got {self.kv_weight}")
        for name in ("prefix_cache_mb", "decode_cache_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"node config: {name} must be >= 0, got "
                                 f"{getattr(self, name)}")
        if self.pipeline < 0:
            raise ValueError(f"node config: pipeline must be >= 0, got {self.pipeline}")
        if self.prefill_chunk and self.mode is not Mode.COLOCATED:
            raise ValueError("node config: prefill_chunk chunks the prompts of colocated "
                             "token pipelines; P-nodes run whole prompts")
        try:
            check_prefill_chunk(self.prefill_chunk, self.max_batch)
        except ValueError as exc:
            raise ValueError(f"node config: {exc}") from None
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(f"node config: dead_after_s ({self.dead_after_s}) must exceed "
                             f"heartbeat_s ({self.heartbeat_s})")
        if self.role is Role.SPARE and (self.depth < 2 or self.replicate != "on"):
            raise ValueError("node config: a spare takes over a stage of a pipeline deeper "
                             "than 1 from replicas in memory (replicate on)")
        if self.role is Role.PREFILL_SPARE and self.mode is not Mode.DISAGGREGATED:
            raise ValueError("node config: a P spare takes over a lost P-node: disaggregated "
                             "mode only")
        if self.replicates and self.replicate is ReplicateMode.DISK and not self.replica_dir:
            raise ValueError("node config: replicate=disk needs a replica_dir")
        if self.role is Role.FRONTEND and not self.decode_urls:
            raise ValueError("node config: a frontend needs decode_urls")
        if (self.role is Role.FRONTEND and self.mode is Mode.DISAGGREGATED
                and not self.prefill_urls):
            raise ValueError("node config: a disaggregated frontend needs prefill_urls")

    @property
    def device(self) -> str:
        """Where its engine runs: a node given GPUs sees only those (CUDA_VISIBLE_DEVICES)."""
        return "cuda" if self.devices.startswith("cuda") else "cpu"

    @property
    def tensorrt_llm_decoupled(self) -> bool:
        """Whether the frontend's tensorrt_llm model is deployed decoupled."""
        if self.trtllm_decoupled is None:
            return self.trtllm_api is TrtllmApi.LEGACY
        return self.trtllm_decoupled

    @property
    def replicates(self) -> bool:
        """Whether this T-stage keeps KV replicas (only pipelines deeper than 1 do)."""
        return self.role is Role.DECODE and self.depth > 1 and self.replicate != "off"

    def pipeline_sequences(self) -> list[int]:
        """Frontend: the sequences each token pipeline holds at once: ``depth``
        microbatches of ``max_batch``, and prompts waiting for a seat in its prompt-KV
        slots."""
        slots = self.num_slots or PROMPT_SLOTS
        return [len(stages) * self.max_batch + slots for stages in self.decode_urls]

    def max_sequences(self) -> int:
        """Frontend: the sequences its token pipelines hold at once, all together. A
        request of more could never be in flight whole."""
        return sum(self.pipeline_sequences())

    def concurrent_requests(self) -> int:
        """Frontend: requests served at once: ``max_requests``, else one for every sequence
        its pipelines hold (at least 64): a fixed 64 left half of 8 machines' batches of 16
        empty."""
        return self.max_requests or max(64, self.max_sequences())

    def secret(self) -> bytes:
        """The cluster secret: ``secret_file``'s hex (a file only its owner may read), else
        ``$DEJAVU_SECRET``'s (:func:`orchestrator.control.auth.load_secret`)."""
        return load_secret(self.secret_file or None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"node config: not JSON ({exc})") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: object) -> NodeConfig:
        if not isinstance(data, dict):
            raise ValueError("node config: expected a JSON object")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"node config: unknown fields {', '.join(sorted(unknown))}")
        missing = {"role", "model_dir"} - set(data)
        if missing:
            raise ValueError(f"node config: missing {', '.join(sorted(missing))}")
        return cls(**data)


def _coerce(name: str, value: object, hint: object) -> object:
    """``value`` as the field's type (JSON gives lists and strings), or a ValueError."""
    if isinstance(hint, types.UnionType):  # only ``X | None`` here
        if value is None:
            return None
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, list | tuple):
            raise ValueError(f"node config: {name} must be a list, got {value!r}")
        return tuple(_coerce(name, v, item) for v in value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(m.value for m in hint)
            raise ValueError(f"node config: {name} must be one of {choices}, "
                             f"got {value!r}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"node config: {name} must be true or false, got {value!r}")
        return value
    if not isinstance(value, hint) or isinstance(value, bool):
        raise ValueError(f"node config: {name} must be {hint.__name__}, got {value!r}")
    return value
