"""Detokenize ``TOKENS_BATCH`` (each beam's first ``SEQUENCE_LENGTH`` tokens) into ``OUTPUT``,
one text per beam, as the TensorRT-LLM backend's postprocessing model does."""

from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.params import RequestError
from orchestrator.serving.text import detokenize_batch


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(pb.node_config(args).model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = pb.inputs(request, ["TOKENS_BATCH", "SEQUENCE_LENGTH"])
            try:
                texts = detokenize_batch(self.tokenizer, tensors["TOKENS_BATCH"],
                                         tensors["SEQUENCE_LENGTH"])
                responses.append(pb.response(OUTPUT=texts))
            except RequestError as exc:
                responses.append(pb.refused(f"postprocessing: {exc}"))
        return responses
