"""tensorrt_llm under ``--trtllm-api llmapi``: TensorRT-LLM's LLM-API model (text in,
``sampling_param_*``, text out; :mod:`orchestrator.serving.llmapi`), served through the
frontend's Frontend as tensorrt_llm_bls is. Not decoupled unless deployed so (its
model.yaml's default): then a request gets one response. A ``stop`` true request ends the
running requests of its request id and, as the published model does, answers CANCELLED; so
does a stopped or client-cancelled request (a non-decoupled model owes it one response)."""

from orchestrator.engine.tokenizer import end_and_pad_ids, load_tokenizer
from orchestrator.serving import pb
from orchestrator.serving.entry import EntryPoint, Replies
from orchestrator.serving.llmapi import INPUTS, LlmapiReply, StopRegistry, is_stop, llmapi_jobs
from orchestrator.serving.params import RequestError

CANCELLED = "Request cancelled by client"


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.end_pad = end_and_pad_ids(config.model_dir, self.tokenizer)
        metrics = pb.TritonMetrics(config.name or "frontend", model="tensorrt_llm")
        self.entry = EntryPoint.for_node(config, metrics, self.tokenizer)
        self.decoupled = pb.decoupled(args)
        self.stops = StopRegistry()

    def execute(self, requests):
        for request in requests:
            if is_stop(pb.inputs(request, ["stop"])):
                self.stop(request)
            else:
                self.submit(request)

    def stop(self, request):
        sender = request.get_response_sender()
        try:
            self.stops.stop(request.request_id())
        except RequestError as exc:
            pb.send(sender, pb.refused(str(exc)), final=True)
            return
        pb.send(sender, pb.cancelled_error(CANCELLED), final=True)

    def submit(self, request):
        request_id, sender = request.request_id(), request.get_response_sender()
        stopped = self.stops.register(request_id)
        reply = LlmapiReply(self.tokenizer, self.end_pad[0])

        def send(response, final):
            if final:
                self.stops.unregister(request_id, stopped)
            pb.send(sender, response, final)

        replies = Replies(
            lambda tokens, _context, meta, final: send(
                pb.response(**reply.respond(tokens, meta, final)), final),
            lambda message, final: send(pb.error(message), final),
            lambda message: send(pb.refused(message), True),
            lambda: send(pb.cancelled_error(CANCELLED), True))
        client_cancelled = pb.cancelled(request)
        self.entry.submit(
            lambda: llmapi_jobs(self.entry, self.tokenizer, self.end_pad, self.decoupled,
                                pb.inputs(request, list(INPUTS)), pb.parameters(request),
                                reply),
            replies, lambda: stopped.is_set() or client_cancelled())

    def finalize(self):
        self.entry.close()
