"""What the fault tests ask of the controller beyond what a serving node needs."""

from __future__ import annotations

import logging
import time

import grpc

from orchestrator.fault.client import ControllerClient
from orchestrator.fault.rpc import Stub

log = logging.getLogger("dejavu.tests.fault")


def wait_for_plan(controller: str, secret: bytes, pipeline: str, after_epoch: int,
                  timeout_s: float, poll_s: float = 0.02) -> dict:
    """Block until the controller has a plan for ``pipeline`` newer than ``after_epoch``."""
    stub = Stub(controller, secret)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                reply = stub.call("Plan", {"pipeline": pipeline, "after_epoch": after_epoch}, 1.0)
                if reply["plan"] is not None:
                    return reply["plan"]
            except grpc.RpcError as e:  # the controller may be restarting: poll on
                log.debug("plan poll failed: %s", e.code())
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no recovery plan for pipeline {pipeline!r} after epoch "
                                   f"{after_epoch} within {timeout_s} s")
            time.sleep(poll_s)
    finally:
        stub.close()


def unsent_acks(client: ControllerClient) -> int:
    """Acks ``client`` recorded that the controller does not have yet."""
    with client._lock:
        return len(client._unsent)
