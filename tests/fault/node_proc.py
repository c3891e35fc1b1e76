"""A node process that only registers and heartbeats: what ``kill -9`` is done to in tests.

Usage: ``python node_proc.py CONTROLLER PIPELINE STAGE DEPTH HEARTBEAT_S``; prints
its node id once connected, then beats until killed or, as a Triton stub's node does,
until its parent process is gone.
"""

from __future__ import annotations

import os
import sys
import time

from orchestrator.control.auth import load_secret
from orchestrator.fault.client import ControllerClient, NodeSpec


def main() -> None:
    controller, pipeline, stage, depth, heartbeat_s = sys.argv[1:6]
    parent = os.getppid()
    client = ControllerClient(  # the secret from DEJAVU_SECRET
        controller, NodeSpec(pipeline, int(stage), int(depth)), load_secret(),
        float(heartbeat_s), alive=lambda: os.getppid() == parent,
    ).start()
    deadline = time.monotonic() + 30
    while not client.connected:
        if time.monotonic() > deadline:
            sys.exit("never connected to the controller")
        time.sleep(0.01)
    print(client.node_id, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
