"""Tokenize each row's ``text_input`` into ``input_ids`` (rows padded to the longest, with
``input_lengths``), each row signed (``input_auth``) for the orchestrator, and its
``stop_words`` / ``bad_words`` into token lists; a prompt over the byte limit is refused
before it is decoded or tokenized. ``end_id`` / ``pad_id`` pass on, the tokenizer's where the
client sent none, as the TensorRT-LLM backend's preprocessing fills them in."""

from orchestrator.control.auth import sign_prompt
from orchestrator.engine.tokenizer import end_and_pad_ids, load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.text import TEXT_INPUTS, encode_batch


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.secret = config.secret()
        self.limits = RequestLimits.for_node(config, self.tokenizer)
        self.end_pad = end_and_pad_ids(config.model_dir, self.tokenizer)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                encoded = encode_batch(self.tokenizer, self.limits,
                                       pb.inputs(request, list(TEXT_INPUTS)), self.end_pad)
                rows = [ids[:n] for ids, n in zip(encoded["input_ids"],
                                                  encoded["input_lengths"][:, 0], strict=True)]
                auth = pb.strings(*[sign_prompt(self.secret, row.tobytes()) for row in rows])
                responses.append(pb.response(**encoded, input_auth=auth.reshape(-1, 1)))
            except ValueError as exc:
                responses.append(pb.refused(f"preprocessing: {exc}"))
        return responses
