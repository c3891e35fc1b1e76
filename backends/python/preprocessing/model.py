"""Tokenize ``text_input`` into ``input_ids``."""

from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.text import encode_prompt


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(pb.node_config(args).model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prompt = pb.text(pb.inputs(request, ["text_input"])["text_input"])
                prompt_ids = encode_prompt(self.tokenizer, prompt)
                responses.append(pb.response(input_ids=pb.ids(prompt_ids)))
            except (ValueError, UnicodeDecodeError) as exc:
                responses.append(pb.error(f"preprocessing: {exc}"))
        return responses
