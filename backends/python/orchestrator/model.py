"""Frontend, decoupled: split a batched request into sequences, route each to a P-node and a
token pipeline, relay their tokens as text. Serves the ensemble only: each row's
``input_auth`` must be preprocessing's signature of its ``input_ids``."""

from orchestrator.control.auth import check_prompt
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.entry import EntryPoint
from orchestrator.serving.params import INPUTS
from orchestrator.serving.text import decode_response


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.secret = config.secret()
        self.tokenizer = load_tokenizer(config.model_dir)
        instance = args["model_instance_name"] if config.frontend_instances > 1 else ""
        self.entry = EntryPoint.for_node(config, pb.TritonMetrics(config.name or "frontend",
                                                                  instance=instance))

    def execute(self, requests):
        pb.serve(self.entry, requests, self.jobs, self.respond)

    def jobs(self, request):
        tensors = pb.inputs(request, ["input_ids", "input_lengths", "input_auth", *INPUTS])
        return self.entry.split(tensors, self.verify)

    def verify(self, prompt, signature):
        check_prompt(self.secret, signature, pb.ids(prompt).tobytes())

    def respond(self, tokens, context, meta):
        return decode_response(self.tokenizer, tokens, context, meta)

    def finalize(self):
        self.entry.close()
