"""The torch engine on its own: KV contents, the layer hook, stage splits, bad input."""

from __future__ import annotations

import pytest
import torch

from orchestrator.engine.reference import load_stages
from orchestrator.engine.torch_engine import load_engine
from orchestrator.layout import StageSpec

ARCHS = ["gpt2", "opt", "llama"]
PROMPTS = [[5, 17, 300, 42, 8, 99, 250], [77], [12, 256, 31, 9, 500]]
# Against HF: same math, different kernels (fused QKV, SDPA), so float32 rounding differs.
FLOAT_NOISE = dict(rtol=1e-4, atol=1e-4)


def ids(prompts=PROMPTS) -> list[torch.Tensor]:
    return [torch.tensor(p) for p in prompts]


def hf_kv(model_dir, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) ``[kv_heads, T, head_dim]`` as HF's own cache holds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_kv_equals_hf_cache(tiny_model, arch):
    model_dir = tiny_model(arch)
    engine = load_engine(model_dir)
    caches = [engine.new_cache() for _ in PROMPTS]
    engine.prefill(ids(), caches)
    for prompt, cache in zip(PROMPTS, caches, strict=True):
        assert cache.length == len(prompt)
        for layer, (k, v) in enumerate(hf_kv(model_dir, prompt)):
            torch.testing.assert_close(cache.layer(layer)[0, :, : len(prompt)], k, **FLOAT_NOISE)
            torch.testing.assert_close(cache.layer(layer)[1, :, : len(prompt)], v, **FLOAT_NOISE)
            assert not cache.layer(layer)[:, :, len(prompt) :].any()


@pytest.mark.parametrize("arch", ARCHS)
def test_on_layer_runs_in_order_after_each_layer_wrote_its_kv(tiny_model, arch):
    model_dir = tiny_model(arch)
    whole = load_engine(model_dir)
    want = [whole.new_cache() for _ in PROMPTS]
    whole.prefill(ids(), want)

    first, second = (load_engine(model_dir, s) for s in StageSpec.split(4, 2))
    seen: list[int] = []

    def on_layer(layer, caches):
        seen.append(layer)
        for got, ref in zip(caches, want, strict=True):
            assert got.length == ref.length
            assert torch.equal(got.layer(layer), ref.layer(layer))  # this layer: written
            if layer + 1 < second.stage.last_layer:
                assert not got.layer(layer + 1).any()  # the next one: not yet

    hidden = first.prefill(ids(), [first.new_cache() for _ in PROMPTS])
    second.prefill(hidden, [second.new_cache() for _ in PROMPTS], on_layer)
    assert seen == [2, 3]


@pytest.mark.parametrize("arch", ARCHS)
def test_stage_boundary_hidden_states_equal_hf(tiny_model, arch):
    """What a first stage of 2 layers hands on, in prefill and in decode, is HF's layer-2 input."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    first = load_engine(model_dir, StageSpec(0, 2, 4))
    caches = [first.new_cache() for _ in PROMPTS]
    hidden = first.prefill(ids(), caches)
    step = first.decode(torch.tensor([1, 2, 3]), caches)
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            out = model(torch.tensor([prompt + [i + 1]]), output_hidden_states=True)
        want = out.hidden_states[2][0]  # the input of layer 2
        torch.testing.assert_close(hidden[i], want[:-1], **FLOAT_NOISE)
        torch.testing.assert_close(step[i], want[-1], **FLOAT_NOISE)


@pytest.mark.parametrize("arch", ARCHS)
def test_three_stages_equal_the_whole_model(tiny_model, arch):
    """Prefill and batched decode: same logits and same KV, layer for layer."""
    model_dir = tiny_model(arch)
    whole = load_engine(model_dir)
    stages = load_stages(model_dir, 3)
    assert [e.stage.count for e in stages] == [2, 1, 1]
    whole_caches = [whole.new_cache() for _ in PROMPTS]
    stage_caches = [[e.new_cache() for _ in PROMPTS] for e in stages]

    want = torch.stack(whole.prefill(ids(), whole_caches))
    x = ids()
    for engine, caches in zip(stages, stage_caches, strict=True):
        x = engine.prefill(x, caches)
        if not engine.stage.is_last:
            assert [tuple(h.shape) for h in x] == [(len(p), 64) for p in PROMPTS]
    torch.testing.assert_close(torch.stack(x), want, rtol=0, atol=1e-5)

    step = torch.tensor([1, 2, 3])
    for _ in range(3):
        want = whole.decode(step, whole_caches)
        h = step
        for engine, caches in zip(stages, stage_caches, strict=True):
            h = engine.decode(h, caches)
        torch.testing.assert_close(h, want, rtol=0, atol=1e-5)
        step = want.argmax(-1)

    for engine, caches in zip(stages, stage_caches, strict=True):
        for got, ref in zip(caches, whole_caches, strict=True):
            assert got.length == ref.length
            for layer in range(engine.stage.first_layer, engine.stage.last_layer):
                torch.testing.assert_close(got.layer(layer), ref.layer(layer), rtol=0, atol=1e-5)


# Each prompt cut at a different point: a one-token prefix, a one-token rest, the middle.
CUTS = [3, 0, 4]  # prompt 1 (one token) has no cut: it runs whole in the second part


def prefill_in_two_parts(stages, prompts=PROMPTS, cuts=CUTS):
    """The prompts' prefixes, then their rests on top, through ``stages`` in order; a prompt
    with cut 0 runs whole in the second part. Returns (last stage's output, caches)."""
    caches = [[e.new_cache() for _ in prompts] for e in stages]
    firsts = [i for i, c in enumerate(cuts) if c]
    x = ids([prompts[i][: cuts[i]] for i in firsts])
    for engine, stage_caches in zip(stages, caches, strict=True):
        x = engine.prefill(x, [stage_caches[i] for i in firsts])
    x = ids([p[c:] for p, c in zip(prompts, cuts, strict=True)])
    for engine, stage_caches in zip(stages, caches, strict=True):
        x = engine.prefill(x, stage_caches)
    return x, caches


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("depth", [1, 2])
def test_prefill_on_a_cached_prefix_equals_the_whole_prompt(tiny_model, arch, depth):
    """Prefix first, the rest on top (whole model and split into stages): the same KV, the
    same next-token logits and the same greedy tokens after, as one whole prefill."""
    model_dir = tiny_model(arch)
    whole = load_engine(model_dir)
    want_caches = [whole.new_cache() for _ in PROMPTS]
    want = torch.stack(whole.prefill(ids(), want_caches))

    stages = load_stages(model_dir, depth)
    got, caches = prefill_in_two_parts(stages)
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=1e-5)
    for engine, stage_caches in zip(stages, caches, strict=True):
        for cache, ref in zip(stage_caches, want_caches, strict=True):
            assert cache.length == ref.length
            for layer in engine.kv_layout.layer_range:
                torch.testing.assert_close(cache.layer(layer), ref.layer(layer), rtol=0, atol=1e-5)

    step, want_step = torch.stack(got).argmax(-1), want.argmax(-1)
    for _ in range(4):
        assert torch.equal(step, want_step)
        want_step = whole.decode(want_step, want_caches).argmax(-1)
        h = step
        for engine, stage_caches in zip(stages, caches, strict=True):
            h = engine.decode(h, stage_caches)
        step = h.argmax(-1)


def test_prefill_on_a_cached_prefix_fires_on_layer_with_the_grown_length(tiny_model):
    engine = load_engine(tiny_model("gpt2"))
    cache = engine.new_cache()
    engine.prefill(ids([[1, 2, 3]]), [cache])
    seen: list[tuple[int, int]] = []
    engine.prefill(ids([[4, 5]]), [cache], lambda layer, cs: seen.append((layer, cs[0].length)))
    assert seen == [(layer, 5) for layer in range(4)]


def test_prefill_past_the_slot_on_a_cached_prefix_is_refused(tiny_model):
    engine = load_engine(tiny_model("gpt2"), max_seq_len=8)
    cache = engine.new_cache()
    engine.prefill(ids([[1, 2, 3, 4, 5]]), [cache])
    before = cache.data.clone()
    with pytest.raises(ValueError, match="prompt 0 has 4 tokens on 5 cached; need 1..3"):
        engine.prefill(ids([[1, 2, 3, 4]]), [cache])
    assert cache.length == 5 and torch.equal(cache.data, before)


def test_batched_decode_equals_one_by_one(tiny_model):
    """Different lengths in one decode step give each sequence its own result."""
    engine = load_engine(tiny_model("llama"))
    batch = [engine.new_cache() for _ in PROMPTS]
    engine.prefill(ids(), batch)
    step = torch.tensor([7, 8, 9])
    batched = engine.decode(step, batch)
    for i, prompt in enumerate(PROMPTS):
        alone = [engine.new_cache()]
        engine.prefill(ids([prompt]), alone)
        torch.testing.assert_close(engine.decode(step[i : i + 1], alone)[0], batched[i])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny_model, dtype):
    model_dir = tiny_model("llama")
    full, half = load_engine(model_dir), load_engine(model_dir, dtype=dtype)
    assert half.new_cache().data.dtype == getattr(torch, dtype)
    want = torch.stack(full.prefill(ids(), [full.new_cache() for _ in PROMPTS]))
    got = torch.stack(half.prefill(ids(), [half.new_cache() for _ in PROMPTS]))
    assert got.dtype == torch.float32  # logits are returned in float32 for sampling
    assert (got - want).abs().max() < 0.1 * want.abs().max()


# -- bad input ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_stages(tiny_model):
    return load_stages(tiny_model("gpt2"), 2)


def test_prompt_longer_than_the_slot(tiny_model):
    engine = load_engine(tiny_model("gpt2"), max_seq_len=8)
    with pytest.raises(ValueError, match="prompt 1 has 9 tokens on 0 cached; need 1..8"):
        engine.prefill(ids([[1], [1] * 9]), [engine.new_cache(), engine.new_cache()])


def test_full_cache_refuses_decode(tiny_model):
    engine = load_engine(tiny_model("gpt2"), max_seq_len=4)
    cache = engine.new_cache()
    engine.prefill(ids([[1, 2, 3, 4]]), [cache])
    with pytest.raises(ValueError, match="cache 0 is full"):
        engine.decode(torch.tensor([5]), [cache])


@pytest.mark.parametrize(
    "inputs, match",
    [
        ([torch.tensor([], dtype=torch.long)], "prompt 0 has 0 tokens"),
        ([torch.tensor([1, 512])], r"token id out of range \[0, 512\)"),
        ([torch.tensor([-1])], "token id out of range"),
        ([torch.zeros(3, 64)], "first stage takes 1-D token ids"),
        ([], "empty batch"),
    ],
)
def test_bad_first_stage_input(gpt2_stages, inputs, match):
    first = gpt2_stages[0]
    with pytest.raises(ValueError, match=match):
        first.prefill(inputs, [first.new_cache() for _ in inputs])


def test_bad_later_stage_input(gpt2_stages):
    last = gpt2_stages[1]
    with pytest.raises(ValueError, match=r"stage takes \[T, 64\] hidden states, got \(3,\)"):
        last.prefill([torch.tensor([1, 2, 3])], [last.new_cache()])
    with pytest.raises(ValueError, match=r"got \(2, 32\)"):
        last.decode(torch.zeros(2, 32), [last.new_cache(), last.new_cache()])


def test_mismatched_caches(gpt2_stages):
    first, last = gpt2_stages
    with pytest.raises(ValueError, match="1 inputs but 2 caches"):
        first.prefill(ids([[1]]), [first.new_cache(), first.new_cache()])
    with pytest.raises(ValueError, match="cache 0 has layout"):
        first.prefill(ids([[1]]), [last.new_cache()])


def test_failed_prefill_leaves_caches_untouched(gpt2_stages):
    first = gpt2_stages[0]
    caches = [first.new_cache(), first.new_cache()]
    with pytest.raises(ValueError):
        first.prefill([torch.tensor([1, 2]), torch.tensor([999])], caches)
    assert [c.length for c in caches] == [0, 0]


def test_missing_checkpoint_files(tmp_path, tiny_model):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_engine(tmp_path)
    (tmp_path / "config.json").write_text((tiny_model("gpt2") / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_engine(tmp_path)


def test_bad_load_arguments(tiny_model):
    model_dir = tiny_model("gpt2")
    with pytest.raises(ValueError, match="does not fit a 4-layer model"):
        load_engine(model_dir, StageSpec(0, 2, 6))
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        load_engine(model_dir, dtype="float8")
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        load_engine(model_dir, max_seq_len=1000)
