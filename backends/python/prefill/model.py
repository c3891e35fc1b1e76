"""P-node: prefill on the prompt stages, stream each layer's KV to the T-stage of its ticket
(``kv_ticket``: one per stage of the chosen token pipeline), return the first token. Every
request must be signed with the cluster secret; failures come back as ``error_code`` and
``error``. A prefill whose client left (the frontend ended the request on the T-node, whose KV
slot then reads ended; it never cancels this call) stops after the layer in progress. ``op``
(``assume``, ``standby``): a control request to a warm P spare, answered with ``reply``
(:mod:`orchestrator.serving.prefill_role`)."""

from orchestrator.control.errors import code_of
from orchestrator.engine.log_probs import encode as encode_log_probs
from orchestrator.serving import pb
from orchestrator.serving.node import load_prefill_worker
from orchestrator.serving.params import GenerationParams
from orchestrator.serving.prefill_role import PrefillRole
from orchestrator.serving.prefill_worker import PrefillJob


def _failure(exc):
    return pb.failure(code_of(exc), f"prefill: {exc}")


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.verifier = pb.verifier(config)
        self.worker = load_prefill_worker(config, pb.TritonMetrics(config.name))
        self.role = PrefillRole(config)

    def execute(self, requests):
        jobs, responses, cursors = [], [None] * len(requests), {}
        for i, request in enumerate(requests):
            tensors = pb.inputs(request, ["input_ids", "kv_ticket", "params", "kv_since", "op",
                                          "peers"])
            try:
                if tensors["op"] is not None:
                    responses[i] = self._control(request, tensors)
                    continue
                pb.check_signed(request, self.verifier, "prefill", "prefill")
                self.role.check_serving()
                if any(tensors[k] is None for k in ("input_ids", "kv_ticket", "params")):
                    raise ValueError("a prefill needs input_ids, kv_ticket and params")
                params = GenerationParams.from_json(tensors["params"])
                tickets = list(tensors["kv_ticket"].reshape(-1))
                prompt = tensors["input_ids"].reshape(-1).tolist()
                if tensors["kv_since"] is not None:
                    cursors[i] = pb.text(tensors["kv_since"])
                jobs.append((i, PrefillJob(request.request_id(), prompt, params, tickets,
                                           pb.cancelled(request))))
            except (ValueError, PermissionError) as exc:
                responses[i] = _failure(exc)
        results = self.worker.run([job for _, job in jobs])
        for (i, _), result in zip(jobs, results, strict=True):
            if isinstance(result, Exception):
                responses[i] = _failure(result)
            else:
                outputs = {"output_ids": pb.ids([result.token]),
                           "cached_tokens": pb.ids([result.cached_tokens])}
                if result.log_prob is not None:
                    outputs["log_probs"] = pb.strings(encode_log_probs([result.log_prob]))
                events = self.worker.kv_events(cursors[i]) if i in cursors else None
                if events is not None:
                    outputs["kv_events"] = pb.strings(events)
                responses[i] = pb.response(**outputs)
        return responses

    def _control(self, request, tensors):
        try:
            op = pb.text(tensors["op"])
            pb.check_signed(request, self.verifier, "prefill", op)
            peers = [] if tensors["peers"] is None else list(tensors["peers"].reshape(-1))
            return pb.response(reply=pb.strings(self.role.control(op, peers)))
        except Exception as exc:  # e.g. the controller refused the place: the caller says
            return _failure(exc)

    def finalize(self):
        self.role.stop()
