"""tensorrt_llm, decoupled: the TensorRT-LLM backend's token-level model. Token ids in, token
ids out, batched and streaming or not: the frontend's Frontend with no tokenizer or
detokenizer; the inputs are read as the ensemble's (:mod:`orchestrator.serving.token_request`)
and the responses shaped as the backend's (:func:`orchestrator.serving.outputs.token_outputs`)."""

from orchestrator.serving import pb
from orchestrator.serving.entry import EntryPoint
from orchestrator.serving.outputs import token_outputs
from orchestrator.serving.token_request import TOKEN_INPUTS, token_jobs


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        metrics = pb.TritonMetrics(config.name or "frontend", model="tensorrt_llm")
        self.entry = EntryPoint.for_node(config, metrics)

    def execute(self, requests):
        pb.serve(self.entry, requests, self.jobs, token_outputs)

    def jobs(self, request):
        return token_jobs(self.entry.split, pb.inputs(request, list(TOKEN_INPUTS)))

    def finalize(self):
        self.entry.close()
