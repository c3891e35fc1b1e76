"""tensorrt_llm_bls, decoupled: the ensemble's contract (text in, text out, batched) served
in-process: preprocessing's tokenizing and checks, the Frontend and its detokenizing, as
library calls. Unlike the ensemble's, a client's cancellation reaches the
Frontend, which cancels the request on the T-node. A missing ``end_id`` / ``pad_id`` is
the tokenizer's, as with the ensemble (the backend's BLS takes them from preprocessing)."""

from orchestrator.engine.tokenizer import end_and_pad_ids, load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.entry import EntryPoint
from orchestrator.serving.params import INPUTS
from orchestrator.serving.text import TEXT_INPUTS, decode_response, encode_batch


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.end_pad = end_and_pad_ids(config.model_dir, self.tokenizer)
        metrics = pb.TritonMetrics(config.name or "frontend", model="tensorrt_llm_bls",
                                   instance=args["model_instance_name"])
        self.entry = EntryPoint.for_node(config, metrics, self.tokenizer)

    def execute(self, requests):
        pb.serve(self.entry, requests, self.jobs, self.respond)

    def jobs(self, request):
        tensors = pb.inputs(request, [*TEXT_INPUTS, *INPUTS])
        return self.entry.split({**tensors, **encode_batch(self.tokenizer, self.entry.limits,
                                                           tensors, self.end_pad)})

    def respond(self, tokens, context, meta):
        return decode_response(self.tokenizer, tokens, context, meta)

    def finalize(self):
        self.entry.close()
