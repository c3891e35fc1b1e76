"""tensorrt_llm: the TensorRT-LLM backend's token-level model. Token ids in, token
ids out, batched and streaming or not: the frontend's Frontend with no tokenizer or
detokenizer; the inputs are read as the ensemble's (:mod:`orchestrator.serving.token_request`)
and the responses shaped as the backend's (:func:`orchestrator.serving.outputs.token_outputs`).
Decoupled unless deployed otherwise (``dejavu up --trtllm-decoupled false``, the backend's
``decoupled_mode``): then a request gets one response through the same response sender
(Triton 2.51's Python backend takes exactly one, with the final flag, from a non-decoupled
model), and streaming or several sequences are refused, as the backend refuses them."""

from orchestrator.serving import pb
from orchestrator.serving.entry import EntryPoint
from orchestrator.serving.outputs import token_outputs
from orchestrator.serving.token_request import TOKEN_INPUTS, check_unary, token_jobs


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        metrics = pb.TritonMetrics(config.name or "frontend", model="tensorrt_llm")
        self.entry = EntryPoint.for_node(config, metrics)
        self.decoupled = pb.decoupled(args)

    def execute(self, requests):
        pb.serve(self.entry, requests, self.jobs, token_outputs)

    def jobs(self, request):
        jobs = token_jobs(self.entry.split, pb.inputs(request, list(TOKEN_INPUTS)))
        return jobs if self.decoupled else check_unary(jobs)

    def finalize(self):
        self.entry.close()
