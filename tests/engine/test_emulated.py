"""The emulated engine: profile timing at one node, deterministic and token-exact tokens."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from orchestrator.engine.config import ModelConfig
from orchestrator.engine.emulated import EmulatedEngine, emulated_reference, load_emulated_engine
from orchestrator.layout import StageSpec
from orchestrator.profiles.profile import EngineProfile, Machine, load_profile


def profile(prefill_ms: float = 200.0, decode_ms: float = 60.0) -> EngineProfile:
    return EngineProfile(
        name="flat", model="toy", machine=Machine("box", "1x cpu"),
        prefill_tokens=(1, 1000), prefill_ms=(prefill_ms, 2 * prefill_ms),
        decode_batch=(1, 8), decode_context=(1, 1000),
        decode_ms=((decode_ms, decode_ms), (2 * decode_ms, 2 * decode_ms)),
        kv_bytes_per_token=4096, kv_memory_bytes=1 << 30, source="test",
    )


def generate(engines: list[EmulatedEngine], prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy through a pipeline of stage engines, batch of every prompt."""
    caches = [[e.new_cache() for _ in prompts] for e in engines]
    xs = [torch.tensor(p) for p in prompts]
    for e, c in zip(engines, caches, strict=True):
        xs = e.prefill(xs, c)
    ids = torch.stack(xs).argmax(-1)
    out = [[int(i)] for i in ids]
    for _ in range(n - 1):
        x = ids
        for e, c in zip(engines, caches, strict=True):
            x = e.decode(x, c)
        ids = x.argmax(-1)
        for row, i in zip(out, ids, strict=True):
            row.append(int(i))
    return out


PROMPTS = [[5, 9, 2, 7], [1], [3, 3, 3, 3, 3, 3, 3, 3, 3]]


def test_tokens_match_the_reference_whole_and_pipelined(tiny_model):
    model = tiny_model("llama")
    cfg = ModelConfig.from_dir(model)
    fast = profile(0.01, 0.01)
    expect = [emulated_reference(p, 12, cfg.vocab_size) for p in PROMPTS]
    whole = load_emulated_engine(str(model), fast, max_seq_len=64)
    assert generate([whole], PROMPTS, 12) == expect
    stages = [EmulatedEngine(cfg, s, fast, 64) for s in StageSpec.split(cfg.num_layers, 3)]
    assert generate(stages, PROMPTS, 12) == expect
    assert len({tuple(t) for t in expect}) == len(PROMPTS)  # not one constant token


def test_the_state_travels_with_the_kv(tiny_model):
    """A copy of the KV slot on another engine continues the sequence exactly (as after a
    KV transfer or a recovery from a replica)."""
    model = tiny_model("gpt2")
    a, b = (load_emulated_engine(str(model), profile(0.01, 0.01), max_seq_len=32)
            for _ in range(2))
    cache = a.new_cache()
    first = a.prefill([torch.tensor([4, 8, 15])], [cache])[0].argmax()
    moved = b.new_cache()
    moved.data.copy_(cache.data)
    moved.length = cache.length
    second = b.decode(first[None], [moved])[0].argmax()
    assert [int(first), int(second)] == emulated_reference([4, 8, 15], 2, a.vocab_size)


def test_prefill_on_a_cached_prefix_carries_the_state_on(tiny_model):
    """Prefix first, the rest on top, whole and in stages: the reference's tokens."""
    model = tiny_model("llama")
    cfg = ModelConfig.from_dir(model)
    fast = profile(0.01, 0.01)
    for engines in ([EmulatedEngine(cfg, StageSpec.whole(cfg.num_layers), fast, 64)],
                    [EmulatedEngine(cfg, s, fast, 64) for s in StageSpec.split(cfg.num_layers, 2)]):
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        caches = [e.new_cache() for e in engines]
        for part in (prompt[:5], prompt[5:]):
            x = torch.tensor(part)
            for e, c in zip(engines, caches, strict=True):
                x = e.prefill([x], [c])[0]
        tokens = [int(x.argmax())]
        while len(tokens) < 6:
            x = torch.tensor(tokens[-1:])
            for e, c in zip(engines, caches, strict=True):
                x = e.decode(x, [c])
            tokens.append(int(x[0].argmax()))
        assert tokens == emulated_reference(prompt, 6, cfg.vocab_size)
        assert [c.length for c in caches] == [len(prompt) + 5] * len(engines)


def test_prefill_on_a_cached_prefix_sleeps_the_new_tokens_at_that_context(tiny_model):
    cfg = ModelConfig.from_dir(tiny_model("llama"))
    p = load_profile("splitwise-llama2-70b-h100")
    now = [0.0]

    def sleep(s):
        now[0] += s

    engine = EmulatedEngine(cfg, StageSpec.whole(cfg.num_layers), p, 8192,
                            sleep=sleep, clock=lambda: now[0])
    cache = engine.new_cache()
    engine.prefill([torch.ones(4000, dtype=torch.long)], [cache])
    before = now[0]
    engine.prefill([torch.ones(1000, dtype=torch.long)], [cache])
    assert now[0] - before == pytest.approx(p.prefill_s(1000, cached=4000))
    assert p.prefill_s(1000, cached=4000) == pytest.approx(p.prefill_s(5000) - p.prefill_s(4000))
    assert p.prefill_s(1000, cached=4000) >= p.prefill_s(1000)
    assert p.prefill_s(1, cached=4000) == p.prefill_s(1)  # never below a pass's fixed cost


def test_sleeps_the_profile_for_the_actual_batch_and_stage_share(tiny_model):
    cfg = ModelConfig.from_dir(tiny_model("llama"))
    p = load_profile("splitwise-llama2-70b-h100")
    now = [0.0]  # a fake clock that only the engine's sleeps advance
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    stage = StageSpec.split(cfg.num_layers, 2)[0]
    engine = EmulatedEngine(cfg, stage, p, 64, sleep=sleep, clock=lambda: now[0])
    caches = [engine.new_cache() for _ in range(2)]
    layers: list[int] = []
    engine.prefill([torch.tensor([1] * 10), torch.tensor([2] * 20)], caches,
                   on_layer=lambda layer, _: layers.append(layer))
    assert layers == list(range(stage.first_layer, stage.last_layer))
    assert len(slept) == stage.count  # one wait per layer, before its hook
    assert sum(slept) == pytest.approx(p.prefill_s(30) * engine.share, rel=0.02)
    slept.clear()
    engine.decode(torch.tensor([3, 4]), caches)
    assert sum(slept) == pytest.approx(p.decode_s(2, 16) * engine.share, rel=0.02)
    assert engine.share == pytest.approx(stage.count / cfg.num_layers)
    assert engine.kv_scale == pytest.approx(
        cfg.num_layers * engine.kv_layout.token_bytes_per_layer() / p.kv_bytes_per_token)


def test_a_mixed_step_sleeps_the_chunk_at_its_context_plus_the_token_steps_increment(
        tiny_model):
    """Sarathi's model: a chunk of 512 on 1,024 cached tokens with 8 token steps at context
    600 costs the chunk's prefill plus what the 8 token steps add to a pass; the tokens
    are the same as prefill and decode run apart."""
    cfg = ModelConfig.from_dir(tiny_model("llama"))
    p = load_profile("splitwise-llama2-70b-h100")
    now = [0.0]

    def sleep(s):
        now[0] += s

    engine = EmulatedEngine(cfg, StageSpec.whole(cfg.num_layers), p, 2048,
                            sleep=sleep, clock=lambda: now[0])
    apart = EmulatedEngine(cfg, StageSpec.whole(cfg.num_layers), p, 2048,
                           sleep=lambda s: None)
    outputs = []
    for e in (engine, apart):
        prompt, running = e.new_cache(), [e.new_cache() for _ in range(8)]
        e.prefill([torch.arange(1024) % 50], [prompt])
        e.prefill([torch.full((599,), i) for i in range(8)], running)
        before = now[0]
        if e is engine:
            outputs.append(e.step([torch.arange(512) % 7], [prompt], torch.arange(8), running))
            assert now[0] - before == pytest.approx(p.mixed_s(512, 1024, 8, 600))
        else:
            outputs.append(([e.prefill([torch.arange(512) % 7], [prompt])[0]],
                            e.decode(torch.arange(8), running)))
    (chunk, tokens), (chunk_apart, tokens_apart) = outputs
    assert torch.equal(chunk[0], chunk_apart[0]) and torch.equal(tokens, tokens_apart)
    increment = p.decode_s(8, 600) - p.decode_s(1, p.decode_context[0])
    assert p.mixed_s(512, 1024, 8, 600) == pytest.approx(p.prefill_s(512, 1024) + increment)
    # the token steps ride on the chunk's pass: cheaper than a prefill and a step apart
    assert p.mixed_s(512, 1024, 8, 600) < p.prefill_s(512, 1024) + p.decode_s(8, 600)
    assert p.mixed_s(512, 0, 0, 0) == p.prefill_s(512)
    assert p.mixed_s(0, 0, 8, 600) == p.decode_s(8, 600)


def test_the_increment_matches_distserves_fit_without_its_fixed_cost():
    """DistServe's step fit is a + b*batch*context + c*batch: the increment over the
    smallest step is that fit less a, at the grid's first context, within 0.1 ms."""
    p = load_profile("distserve-opt-13b-a100")
    _, b, c = p.extra["decode_coefficients_small_batch"]
    for batch, context in [(8, 512), (32, 1024), (64, 2048)]:
        fit = b * batch * context + c * batch - (b * p.decode_context[0] + c)
        assert p.decode_increment_s(batch, context) * 1e3 == pytest.approx(fit, abs=0.1)


def wall_times(engine) -> tuple[list[float], list[float]]:
    """Three 3-token prefills, each followed by three decode steps: their wall times."""
    prefills, steps = [], []
    for _ in range(3):
        cache = engine.new_cache()
        start = time.perf_counter()
        ids = engine.prefill([torch.tensor([1, 2, 3])], [cache])[0].argmax()[None]
        prefills.append(time.perf_counter() - start)
        for _ in range(3):
            start = time.perf_counter()
            ids = engine.decode(ids, [cache]).argmax(-1)
            steps.append(time.perf_counter() - start)
    return prefills, steps


def test_wall_time_within_5_percent_of_the_profile_at_one_node(tiny_model):
    model = tiny_model("llama")
    p = profile(prefill_ms=200.0, decode_ms=60.0)
    engine = load_emulated_engine(str(model), p, max_seq_len=64)
    prefills, steps = wall_times(engine)
    assert statistics.median(prefills) == pytest.approx(p.prefill_s(3), rel=0.05)
    assert statistics.median(steps) == pytest.approx(p.decode_s(1, 5), rel=0.05)


def test_time_scale_multiplies_every_step_within_5_percent(tiny_model):
    """--time-scale K: wall time of a prefill and of a step is the profile's x K."""
    k = 4.0
    p = profile(prefill_ms=40.0, decode_ms=15.0)
    engine = load_emulated_engine(str(tiny_model("llama")), p, max_seq_len=64, time_scale=k)
    prefills, steps = wall_times(engine)
    assert statistics.median(prefills) == pytest.approx(p.prefill_s(3) * k, rel=0.05)
    assert statistics.median(steps) == pytest.approx(p.decode_s(1, 5) * k, rel=0.05)
    with pytest.raises(ValueError, match="time_scale"):
        load_emulated_engine(str(tiny_model("llama")), p, max_seq_len=8, time_scale=0)


def test_time_scale_reaches_the_node_config_and_needs_a_profile(tiny_model):
    from orchestrator.serving.config import NodeConfig, Role

    model = str(tiny_model("llama"))
    config = NodeConfig(role=Role.DECODE, model_dir=model, profile="splitwise-llama2-70b-h100",
                        time_scale=8)
    assert NodeConfig.from_json(config.to_json()).time_scale == 8.0
    with pytest.raises(ValueError, match="needs a profile"):
        NodeConfig(role=Role.DECODE, model_dir=model, time_scale=8)
    with pytest.raises(ValueError, match="time_scale"):
        NodeConfig(role=Role.DECODE, model_dir=model, profile="x", time_scale=-1)


def test_bad_input_is_refused(tiny_model):
    engine = load_emulated_engine(str(tiny_model("gpt2")), profile(0.01, 0.01), max_seq_len=8)
    with pytest.raises(ValueError, match="token ids"):
        engine.prefill([torch.tensor([engine.vocab_size])], [engine.new_cache()])
    with pytest.raises(ValueError, match="positions"):
        engine.prefill([torch.tensor([1] * 9)], [engine.new_cache()])
    with pytest.raises(ValueError, match="caches"):
        engine.prefill([torch.tensor([1])], [])
