"""Detokenize ``tokens``; ``context_tokens`` (sent just before) make streamed text exact."""

from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.text import new_text


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(pb.node_config(args).model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = pb.inputs(request, ["tokens", "context_tokens"])
            tokens = tensors["tokens"].reshape(-1).tolist()
            context = tensors["context_tokens"].reshape(-1).tolist()
            output = new_text(self.tokenizer, context, tokens)
            responses.append(pb.response(text_output=pb.strings(output), output_ids=pb.ids(tokens)))
        return responses
