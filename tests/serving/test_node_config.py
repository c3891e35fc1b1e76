"""The node configuration: one typed writer, one JSON parameter, validated once."""

import json
from dataclasses import replace

import pytest

from orchestrator.cluster.topology import Topology, node_configs, write_node_repo
from orchestrator.fault import ReplicateMode
from orchestrator.pipeline import DEAD_AFTER_S, HEARTBEAT_S, PROMPT_SLOTS, SwapMode
from orchestrator.pipeline.node import PipelineConfig
from orchestrator.serving.config import Mode, NodeConfig, Role


def cluster(**settings) -> dict[str, NodeConfig]:
    return node_configs(Topology(prefill=1, decode=2, decode_depth=2),
                        lambda name: f"{name}:8001", lambda name: f"/replicas/{name}",
                        model_dir="/model", **settings)


def test_the_writer_places_every_node_and_tells_each_its_peers():
    configs = cluster(swap="on")
    assert list(configs) == ["prefill0", "decode0s0", "decode0s1", "decode1s0", "decode1s1",
                             "frontend"]
    stage = configs["decode1s1"]
    assert (stage.role, stage.pipeline, stage.stage, stage.depth) == (Role.DECODE, 1, 1, 2)
    assert stage.address == "decode1s1:8001" and stage.swap is SwapMode.ON
    assert configs["frontend"].prefill_urls == ("prefill0:8001",)
    assert configs["frontend"].decode_urls == (("decode0s0:8001", "decode0s1:8001"),
                                               ("decode1s0:8001", "decode1s1:8001"))
    assert all(c.replicates for c in configs.values() if c.role is Role.DECODE)
    assert not configs["prefill0"].replicates and not configs["frontend"].replicates


def test_a_colocated_pipeline_has_no_p_nodes_and_its_stages_know_their_places():
    configs = node_configs(Topology(prefill=0, decode=1, decode_depth=2, colocated=True),
                           lambda name: f"{name}:8001", model_dir="/model")
    assert list(configs) == ["decode0s0", "decode0s1", "frontend"]
    assert [(c.mode, c.stage, c.depth) for c in configs.values() if c.role is Role.DECODE] \
        == [(Mode.COLOCATED, 0, 2), (Mode.COLOCATED, 1, 2)]
    assert configs["frontend"].prefill_urls == ()


def test_p_nodes_may_run_on_other_machines_than_the_token_nodes():
    """Splitwise's mixed pools: the P-nodes' profile (H100), the rest the cluster's (A100)."""
    h100, a100 = "splitwise-llama2-70b-h100", "splitwise-llama2-70b-a100"
    configs = cluster(profile=a100, prefill_profile=h100)
    assert configs["prefill0"].profile == h100
    assert {c.profile for name, c in configs.items() if name != "prefill0"} == {a100}
    with pytest.raises(ValueError, match="emulated engine on every node"):
        cluster(prefill_profile=h100)


def test_prompt_slots_cover_the_p_nodes_feeding_a_pipeline():
    """A request holds a prompt-KV slot of its T-pipeline from before its prefill: 6 P-nodes
    on 2 T-nodes get 48 each (16 a P-node), fewer P-nodes than pipelines the default 16."""
    six_on_two = node_configs(Topology(prefill=6, decode=2), lambda name: f"{name}:8001",
                              model_dir="/model")
    assert {c.num_slots for c in six_on_two.values()} == {48}
    assert six_on_two["frontend"].max_sequences() == 2 * (16 + 48)
    assert {c.num_slots for c in cluster().values()} == {PROMPT_SLOTS}
    assert {c.num_slots for c in cluster(num_slots=4).values()} == {4}  # given: kept


def test_one_set_of_defaults():
    config = NodeConfig(role=Role.DECODE, model_dir="/m")
    pipeline = PipelineConfig(depth=1, batch_size=1)
    assert (config.heartbeat_s, config.dead_after_s) == (HEARTBEAT_S, DEAD_AFTER_S)
    assert (pipeline.heartbeat_s, pipeline.dead_after_s) == (HEARTBEAT_S, DEAD_AFTER_S)
    assert config.replicate is ReplicateMode.ON and config.swap is SwapMode.OFF
    assert not config.replicates  # depth 1: nothing to replicate to


def test_json_round_trip_is_exact():
    for config in cluster(max_seq_len=256, replicate="disk", num_slots=4).values():
        again = NodeConfig.from_json(config.to_json())
        assert again == config and isinstance(again.decode_urls[0], tuple)


@pytest.mark.parametrize(("change", "message"), [
    ({"swap": "sometimes"}, "swap must be one of on, off, auto"),
    ({"replicate": "tape"}, "replicate must be one of on, disk, off"),
    ({"max_batch": "16"}, "max_batch must be int"),
    ({"max_batch": 0}, "max_batch must be > 0"),
    ({"stage": 2}, "stage 2 is not in a depth-2 pipeline"),
    ({"dead_after_s": 0.1}, "dead_after_s (0.1) must exceed heartbeat_s"),
    ({"replicate": "disk", "replica_dir": ""}, "replicate=disk needs a replica_dir"),
    ({"secret": "ab"}, "unknown fields secret"),
    ({"decode_urls": "a+b"}, "decode_urls must be a list"),
])
def test_a_bad_config_is_refused_naming_the_field(change, message):
    data = json.loads(cluster()["decode0s1"].to_json()) | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NodeConfig.from_json(json.dumps(data))


def test_impossible_clusters_are_refused():
    with pytest.raises(ValueError, match="a frontend needs decode_urls"):
        NodeConfig(role=Role.FRONTEND, model_dir="/m")
    with pytest.raises(ValueError, match="disaggregated mode needs at least one prefill"):
        Topology(prefill=0)


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("DEJAVU_SECRET", raising=False)
    config = NodeConfig(role=Role.PREFILL, model_dir="/m")
    with pytest.raises(PermissionError, match="no cluster secret"):
        config.secret()
    monkeypatch.setenv("DEJAVU_SECRET", "ab" * 16)
    assert config.secret() == b"\xab" * 16
    (tmp_path / "secret").write_text("01" * 16 + "\n")
    (tmp_path / "secret").chmod(0o600)
    assert replace(config, secret_file=str(tmp_path / "secret")).secret() == b"\x01" * 16


def test_a_repository_carries_the_config_and_no_secret(tmp_path):
    config = cluster()["decode0s0"]
    write_node_repo(tmp_path, config)
    text = (tmp_path / "decode" / "config.pbtxt").read_text()
    assert 'key: "config"' in text and "secret\\\"" not in text
    value = text.split('key: "config" value: { string_value: "')[1].rsplit('" }', 1)[0]
    assert NodeConfig.from_json(value.replace('\\"', '"').replace("\\\\", "\\")) == config


def test_spares_are_standby_t_nodes_of_the_pipelines_depth():
    configs = node_configs(Topology(decode_depth=2, spares=2), lambda n: f"{n}:1",
                           model_dir="m")
    spares = [c for c in configs.values() if c.role is Role.SPARE]
    assert [c.name for c in spares] == ["spare0", "spare1"]
    assert {c.depth for c in spares} == {2}
    assert all(c.decode_urls == configs["frontend"].decode_urls for c in spares)
    with pytest.raises(ValueError, match="deeper than 1"):
        Topology(decode_depth=1, spares=1)
    with pytest.raises(ValueError, match="replicate on"):
        replace(spares[0], replicate=ReplicateMode.OFF)


def test_prefill_spares_are_standby_p_nodes_with_the_p_nodes_engine():
    configs = node_configs(Topology(prefill_spares=2), lambda n: f"{n}:1", model_dir="m",
                           profile="a100", prefill_profile="h100")
    spares = [c for c in configs.values() if c.role is Role.PREFILL_SPARE]
    assert [c.name for c in spares] == ["pspare0", "pspare1"]
    assert {c.profile for c in spares} == {"h100"}  # a P-node's role: its machine's profile
    assert all(c.role.spare and c.prefill_depth == configs["prefill0"].prefill_depth
               for c in spares)
    with pytest.raises(ValueError, match="colocated"):
        Topology(colocated=True, prefill=0, prefill_spares=1)
    with pytest.raises(ValueError, match="disaggregated mode only"):
        replace(spares[0], mode=Mode.COLOCATED)


def test_tensorrt_llm_is_decoupled_unless_the_deployment_says_not(tmp_path):
    """``--trtllm-decoupled false`` (the backend's decoupled_mode) reaches the frontend's
    tensorrt_llm config alone; a non-boolean value is refused."""
    for decoupled in (True, False):
        config = cluster(trtllm_decoupled=decoupled)["frontend"]
        write_node_repo(tmp_path / str(decoupled), config)
        policies = {model: "decoupled: true" in (tmp_path / str(decoupled) / model
                                                 / "config.pbtxt").read_text()
                    for model in ("tensorrt_llm", "tensorrt_llm_bls", "orchestrator")}
        assert policies == {"tensorrt_llm": decoupled, "tensorrt_llm_bls": True,
                            "orchestrator": True}
    data = json.loads(cluster()["frontend"].to_json()) | {"trtllm_decoupled": "false"}
    with pytest.raises(ValueError, match="trtllm_decoupled must be true or false"):
        NodeConfig.from_json(json.dumps(data))


@pytest.mark.parametrize(("api", "decoupled", "want"), [
    ("legacy", None, True), ("llmapi", None, False), ("llmapi", True, True)])
def test_trtllm_api_picks_the_model_served_as_tensorrt_llm(tmp_path, api, decoupled, want):
    """``--trtllm-api llmapi``: TensorRT-LLM's LLM-API model (its config and model.py) under
    the name tensorrt_llm, not decoupled unless asked (its model.yaml's default); the other
    models as they are."""
    config = cluster(trtllm_api=api, trtllm_decoupled=decoupled)["frontend"]
    write_node_repo(tmp_path, config)
    text = (tmp_path / "tensorrt_llm" / "config.pbtxt").read_text()
    assert ("sampling_param_max_tokens" in text) == (api == "llmapi")
    assert ("decoupled: true" in text) == want
    code = (tmp_path / "tensorrt_llm" / "1" / "model.py").read_text()
    assert ("orchestrator.serving.llmapi" in code) == (api == "llmapi")
    assert "decoupled: true" in (tmp_path / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    data = json.loads(config.to_json()) | {"trtllm_api": "v2"}
    with pytest.raises(ValueError, match="trtllm_api must be one of legacy, llmapi"):
        NodeConfig.from_json(json.dumps(data))


def test_prefill_chunk_needs_colocation_and_room_for_the_token_steps():
    colocated = dict(role=Role.DECODE, model_dir="m", mode=Mode.COLOCATED, max_batch=16)
    assert NodeConfig(**colocated, prefill_chunk=512).prefill_chunk == 512
    assert NodeConfig.from_json(NodeConfig(**colocated, prefill_chunk=64).to_json()
                                ).prefill_chunk == 64
    with pytest.raises(ValueError, match="P-nodes run whole prompts"):
        NodeConfig(role=Role.DECODE, model_dir="m", prefill_chunk=512)
    with pytest.raises(ValueError, match="at least the batch size 16"):
        NodeConfig(**colocated, prefill_chunk=8)
