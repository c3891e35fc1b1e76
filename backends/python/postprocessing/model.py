"""Detokenize ``tokens``; ``context_tokens`` (sent just before, or the prompt) make the text
exact; ``meta`` (the orchestrator's JSON) becomes batch_index, sequence_index, perf metrics
and log-probs."""

import json

import numpy as np

from orchestrator.engine.log_probs import TokenLogProb, response_tensors
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.text import response_text

PERF = {"arrival_time_ns": np.int64, "first_scheduled_time_ns": np.int64,
        "first_token_time_ns": np.int64, "last_token_time_ns": np.int64,
        "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
        "kv_cache_alloc_total_blocks": np.int32}


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(pb.node_config(args).model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = pb.inputs(request, ["tokens", "context_tokens", "meta"])
            tokens = tensors["tokens"].reshape(-1).tolist()
            context = tensors["context_tokens"].reshape(-1).tolist()
            meta = json.loads(pb.text(tensors["meta"]))
            text = response_text(self.tokenizer, tokens, context, meta["full_text"])
            outputs = {
                "text_output": pb.strings(text).reshape(1, 1),
                "output_ids": pb.ids([tokens]),
                "batch_index": pb.ids([[meta["batch_index"]]]),
                "sequence_index": pb.ids([[meta["sequence_index"]]]),
            }
            for name, value in meta.get("perf", {}).items():
                outputs[name] = np.array([[value]], dtype=PERF[name])
            if "log_probs" in meta:
                lp = meta["log_probs"]
                outputs |= response_tensors([TokenLogProb.from_list(p) for p in lp["tokens"]],
                                            lp["cum"], lp["top"])
            responses.append(pb.response(**outputs))
        return responses
