"""The token model tensorrt_llm's requests read as the ensemble's, and every response's
tensors shaped as the backend's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from orchestrator.serving.outputs import PERF, token_outputs
from orchestrator.serving.params import INPUTS, GenerationParams, RequestError
from orchestrator.serving.text import decode_response, detokenize_batch
from orchestrator.serving.token_request import (
    BEAM_ONLY,
    REFUSED,
    RENAMED,
    WORD_LISTS,
    ensemble_tensors,
    token_jobs,
    words,
)

REPO = Path(__file__).resolve().parents[2]


def request(**values) -> dict[str, np.ndarray]:
    """One row as the backend's inflight_batcher_llm_client sends it (after Triton's
    reshape to [batch] of the scalar inputs)."""
    base = {"input_ids": np.array([[5, 6, 7]], np.int32),
            "input_lengths": np.array([3], np.int32),
            "request_output_len": np.array([4], np.int32),
            "beam_width": np.array([1], np.int32), "temperature": np.array([1.0], np.float32),
            "runtime_top_k": np.array([1], np.int32), "runtime_top_p": np.array([0.0], np.float32),
            "end_id": np.array([2], np.int32), "pad_id": np.array([0], np.int32),
            "streaming": np.array([True])}
    return base | values


def test_every_input_of_the_token_model_is_classified():
    config = (REPO / "model_repository/tensorrt_llm/config.pbtxt").read_text()
    declared = set(re.findall(r'\{ name: "(\w+)"', config.split("output [")[0]))
    known = ({"input_ids", "input_lengths", "stop"} | set(RENAMED) | set(WORD_LISTS)
             | set(BEAM_ONLY) | set(REFUSED))
    assert declared - known <= set(INPUTS)  # the rest under the ensemble's names
    assert known <= declared


def test_client_defaults_are_greedy_with_the_ensembles_names():
    tensors = ensemble_tensors(request())
    params = GenerationParams.from_tensors(tensors, row=0)
    assert params.greedy and params.max_tokens == 4 and params.stream
    assert (params.end_id, params.pad_id) == (2, 0)
    sampled = GenerationParams.from_tensors(ensemble_tensors(request(
        runtime_top_k=np.array([5], np.int32), temperature=np.array([0.5], np.float32),
        seed=np.array([9], np.uint64))), row=0)
    assert (sampled.top_k, sampled.temperature, sampled.seed) == (5, 0.5, 9)


def test_word_lists_are_the_backends_token_and_offset_rows():
    lists = np.array([[[4, 5, 6, 9, 0], [2, 3, -1, -1, -1]]], np.int32)
    assert words("stop_words_list", lists[0]) == [[4, 5], [6]]
    params = GenerationParams.from_tensors(
        ensemble_tensors(request(stop_words_list=lists, bad_words_list=lists)), row=0)
    assert params.stop_words == ((4, 5), (6,)) and params.bad_words == ((4, 5), (6,))
    with pytest.raises(RequestError, match="offset 9 outside"):
        words("bad_words_list", np.array([[1, 2], [9, -1]], np.int32))
    with pytest.raises(RequestError, match=r"must be \[batch, 2, n\]"):
        words("stop_words_list", np.array([1, 2], np.int32))


@pytest.mark.parametrize(("name", "value", "message"), [
    ("draft_input_ids", np.array([[1, 2]], np.int32), "speculative decoding"),
    ("embedding_bias", np.array([[0.5]], np.float32), "embedding bias"),
    ("lookahead_window_size", np.array([[7]], np.int32), "lookahead decoding"),
    ("stop", np.array([True]), "to stop a request, cancel it"),
])
def test_unsupported_inputs_are_refused_by_name(name, value, message):
    with pytest.raises(RequestError, match=f"{name}.*{message}|{message}"):
        ensemble_tensors(request(**{name: value}))


def test_token_responses_are_shaped_as_the_backends():
    meta = {"batch_index": 1, "sequence_index": 0, "full_text": False,
            "perf": {"arrival_time_ns": 1, "first_scheduled_time_ns": 2,
                     "first_token_time_ns": 3, "last_token_time_ns": 4,
                     "kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 0,
                     "kv_cache_alloc_total_blocks": 1}}
    streamed = token_outputs([8, 9], [5, 6, 7], meta)
    assert streamed["output_ids"].tolist() == [[[8, 9]]]
    assert streamed["sequence_length"].tolist() == [[2]]
    assert streamed["batch_index"][0][0] == 1 and streamed["sequence_index"].shape == (1, 1)
    assert set(PERF) <= set(streamed) and streamed["acceptance_rate"].dtype == np.float32
    whole = token_outputs([8, 9], [5, 6, 7], meta | {"full_text": True})
    assert whole["output_ids"].tolist() == [[[5, 6, 7, 8, 9]]]
    assert whole["sequence_length"][0][0] == 5


def tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    made = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    return made


def test_text_output_is_one_dimensional_and_postprocessing_decodes_each_beam():
    meta = {"batch_index": 0, "sequence_index": 0, "full_text": True}
    out = decode_response(tokenizer(), [2], [1], meta)
    assert out["text_output"].shape == (1,)
    assert out["text_output"][0].decode("utf-8") == "hello world"
    texts = detokenize_batch(tokenizer(), np.array([[[1, 2, 0]], [[2, 2, 2]]], np.int32),
                             np.array([[2], [1]], np.int32))
    assert [t.decode() for t in texts] == ["hello world", "world"]
    with pytest.raises(RequestError, match="SEQUENCE_LENGTH 4 outside"):
        detokenize_batch(tokenizer(), np.array([[[1, 2, 0]]], np.int32), np.array([[4]], np.int32))


def test_refusals_name_the_token_models_inputs():
    def split(tensors):
        GenerationParams.from_tensors(tensors, row=0)
        return []

    bad = request(runtime_top_p=np.array([1.5], np.float32),
                  request_output_len=np.array([3], np.int32))
    with pytest.raises(RequestError, match=r"^runtime_top_p must be in \[0, 1\], got 1.5$"):
        token_jobs(split, bad)
    with pytest.raises(RequestError, match="request_output_len must be at least 1"):
        token_jobs(split, request(request_output_len=np.array([0], np.int32)))


def test_a_non_decoupled_token_model_takes_one_whole_sequence_per_request():
    """The backend's rule without decoupled_mode: no streaming, one sequence a response."""
    from orchestrator.serving.batch import SequenceJob
    from orchestrator.serving.token_request import check_unary

    def job(stream: bool, index: int = 0) -> SequenceJob:
        return SequenceJob(index, 0, [5, 6], GenerationParams(max_tokens=4, stream=stream))

    assert check_unary([job(False)]) == [job(False)]
    with pytest.raises(RequestError, match="streaming is only supported if tensorrt_llm is "
                                           "deployed decoupled"):
        check_unary([job(True)])
    with pytest.raises(RequestError, match="2 sequences"):
        check_unary([job(False), job(False, 1)])


@pytest.mark.parametrize("length", [-1, 2, 10, 2**31 - 1])
def test_input_lengths_other_than_the_ids_sent_are_refused(length):
    """With 4 ids sent, -1 had dropped the last one, 2 used two and 10 was clipped."""
    from orchestrator.serving.batch import split

    def check(ids, signature, params):
        pass

    ids = np.array([[5, 6, 7, 8]], np.int32)
    sent = request(input_ids=ids, input_lengths=np.array([[length]], np.int32))
    with pytest.raises(RequestError, match=rf"input_lengths {length} is not the number of "
                                           r"ids sent: input_ids has 4 a row"):
        split(ensemble_tensors(sent), check)
    jobs = split(ensemble_tensors(request(input_ids=ids, input_lengths=np.array([[4]]))), check)
    assert [job.prompt_ids for job in jobs] == [[5, 6, 7, 8]]


def test_padded_rows_keep_their_lengths_and_the_longest_fills_the_width():
    from orchestrator.serving.batch import split

    def check(ids, signature, params):
        pass

    rows = {name: np.repeat(value, 2, axis=0) for name, value in request().items()}
    padded = rows | {"input_ids": np.array([[5, 6, 7], [8, 9, 0]], np.int32),
                     "input_lengths": np.array([[3], [2]], np.int32)}
    assert [j.prompt_ids for j in split(ensemble_tensors(padded), check)] == [[5, 6, 7], [8, 9]]
    for lengths, message in [([[2], [2]], r"input_lengths 2 \(batch row 0\) is not the number"),
                             ([[3], [4]], r"input_lengths 4 \(batch row 1\) is not the"),
                             ([[3]], r"one per row of input_ids \(2 rows\)")]:
        with pytest.raises(RequestError, match=message):
            split(ensemble_tensors(padded | {"input_lengths": np.array(lengths, np.int32)}),
                  check)
