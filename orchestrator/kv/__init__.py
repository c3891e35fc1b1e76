"""DejaVuLib: KV-cache layout, movement primitives, transports and the P/T connector.

- ``layout``: the per-sequence slot every component agrees on.
- ``transport/``: one interface (``base``), backends ``local`` (in-process) and ``nixl`` (UCX).
- ``primitives``: flush/fetch, scatter/gather, stream_out/stream_in (DejaVu §4.1).
- ``wire``: the checked, HMAC-authenticated block header and the signed ticket.
- ``connector``: ``KVReceiver`` (decode node) and ``KVSender`` (prefill node).
- ``delta``: token-step deltas, buffered and streamed in the background.
- ``bench``: the Fig. 11 ablation (``dejavu bench kv``).
"""
