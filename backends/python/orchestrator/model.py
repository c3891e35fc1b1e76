"""Frontend, decoupled: route each request to a P-node and a T-node, relay tokens."""

from concurrent.futures import ThreadPoolExecutor

from orchestrator.serving import pb
from orchestrator.serving.frontend import Cancelled, Frontend
from orchestrator.serving.params import PARAM_TENSORS, GenerationParams


class TritonPythonModel:
    def initialize(self, args):
        params = pb.parameters(args)
        split = lambda key: [url for url in params.get(key, "").split(",") if url]  # noqa: E731
        self.frontend = Frontend(split("prefill_urls"), split("decode_urls"))
        self.pool = ThreadPoolExecutor(max_workers=int(params.get("max_requests", "64")))

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self.serve, request)
        return None

    def serve(self, request):
        sender = request.get_response_sender()

        def emit(tokens, context, final):
            response = pb.response(output_ids=pb.ids(tokens), context_ids=pb.ids(context))
            sender.send(response, flags=pb.FINAL if final else 0)

        try:
            tensors = pb.inputs(request, ["input_ids", *PARAM_TENSORS])
            params = GenerationParams.from_tensors(tensors)
            prompt = tensors["input_ids"].reshape(-1).tolist()
            self.frontend.generate(prompt, params, emit, request.is_cancelled)
        except Cancelled:
            sender.send(pb.error("request cancelled"), flags=pb.FINAL)
        except Exception as exc:
            sender.send(pb.error(str(exc)), flags=pb.FINAL)

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
