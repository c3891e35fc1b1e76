"""The cluster's control plane: who may ask (``auth``), what went wrong (``errors``), and
the clients that ask T-nodes and P-nodes (``client``)."""
