"""DejaVuLib: KV movement primitives, transports and the P/T connector.

The per-sequence slot every component agrees on is :mod:`orchestrator.layout`.

- ``transport/``: one interface (``base``), backends ``local`` (in-process) and ``nixl`` (UCX).
- ``primitives``: scatter (a packed block into a strided KV region), stream_out (DejaVu §4.1).
- ``wire``: the checked, MAC-authenticated block header and the signed ticket.
- ``connector``: ``KVReceiver`` (decode node) and ``KVSender`` (prefill node).
- ``delta``: token-step deltas, buffered and streamed in the background.

Its benchmark (Fig. 11, ``dejavu bench kv``) is :mod:`benchmarks.kv`.
"""
