"""The project's measurements (``dejavu bench kv | pipeline | recovery | soak``), apart from the
serving library: they drive :mod:`orchestrator` and report with rich and matplotlib, which
come with the ``bench`` extra (``pip install -e '.[bench]'``; ``dev`` includes it), so a
serving node never needs them.

- ``kv``: the KV streaming ablation (DejaVu Fig. 11).
- ``pipeline``: pipeline bubbles, colocated vs disaggregated, resident vs swapped KV.
- ``recovery``: failure recovery (DejaVu Fig. 14, 15).
- ``soak``: a long mixed load while a process of every role is killed in turn.
"""
