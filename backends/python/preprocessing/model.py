"""Tokenize each row's ``text_input`` into ``input_ids`` (rows padded to the longest, with
``input_lengths``), each row signed (``input_auth``) for the orchestrator, and its
``stop_words`` / ``bad_words`` into token lists; a prompt over the byte limit is refused
before it is decoded or tokenized."""

import numpy as np

from orchestrator.control.auth import sign_prompt
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.text import encode_prompt, encode_words


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
                tensors = pb.inputs(request, ["text_input", "stop_words", "bad_words"])
                rows = [pb.ids(encode_prompt(self.tokenizer, self.limits.check_text(row)))
                        for row in tensors["text_input"]]
                ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
                for i, row in enumerate(rows):
                    ids[i, : len(row)] = row
                auth = pb.strings(*[sign_prompt(self.secret, row.tobytes()) for row in rows])
                words = {name: self.words(tensors[name], len(rows))
                         for name in ("stop_words", "bad_words")}
                responses.append(pb.response(
                    input_ids=ids, input_auth=auth.reshape(-1, 1),
                    input_lengths=pb.ids([[len(r)] for r in rows]),
                    stop_ids=words["stop_words"], bad_ids=words["bad_words"]))
            except ValueError as exc:
                responses.append(pb.refused(f"preprocessing: {exc}"))
        return responses

    def words(self, array, rows):
        """Each row's words as JSON token lists, ``[rows, 1]``."""
        lists = [encode_words(self.tokenizer, [] if array is None else list(array[i]))
                 for i in range(rows)]
        return pb.strings(*lists).reshape(-1, 1)
