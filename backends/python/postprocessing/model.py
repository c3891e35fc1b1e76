"""Detokenize ``tokens``; ``context_tokens`` (sent just before, or the prompt) make the text
exact; ``meta`` (the orchestrator's JSON) becomes batch_index, sequence_index, perf metrics
and log-probs."""

import json

from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.text import decode_response


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(pb.node_config(args).model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = pb.inputs(request, ["tokens", "context_tokens", "meta"])
            outputs = decode_response(self.tokenizer, tensors["tokens"].reshape(-1).tolist(),
                                      tensors["context_tokens"].reshape(-1).tolist(),
                                      json.loads(pb.text(tensors["meta"])))
            responses.append(pb.response(**outputs))
        return responses
