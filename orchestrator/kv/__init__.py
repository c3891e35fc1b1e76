"""DejaVuLib: KV movement primitives, transports and the P/T connector.

The per-sequence slot every component agrees on is :mod:`orchestrator.layout`.

- ``transport/``: one interface (``base``), backends ``local`` (in-process) and ``nixl`` (UCX).
- ``primitives``: flush/fetch, scatter/gather, stream_out/stream_in (DejaVu §4.1).
- ``wire``: the checked, HMAC-authenticated block header and the signed ticket.
- ``connector``: ``KVReceiver`` (decode node) and ``KVSender`` (prefill node).
- ``delta``: token-step deltas, buffered and streamed in the background.

Its benchmark (Fig. 11, ``dejavu bench kv``) is :mod:`benchmarks.kv`.
"""
