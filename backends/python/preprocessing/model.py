"""Tokenize ``text_input`` into ``input_ids``, signed (``input_auth``) for the orchestrator;
a prompt over the byte limit is refused before it is decoded or tokenized."""

from orchestrator.control.auth import sign_prompt
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.text import encode_prompt


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.secret = config.secret()
        self.limits = RequestLimits.for_node(config, self.tokenizer)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prompt = self.limits.check_text(pb.inputs(request, ["text_input"])["text_input"])
                ids = pb.ids(encode_prompt(self.tokenizer, prompt))
                auth = sign_prompt(self.secret, ids.tobytes())
                responses.append(pb.response(input_ids=ids, input_auth=pb.strings(auth)))
            except ValueError as exc:
                responses.append(pb.refused(f"preprocessing: {exc}"))
        return responses
