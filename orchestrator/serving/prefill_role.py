"""A P-node's place with the fault controller, and a warm P spare's takeover.

A P-node registers as ``prefill<pipeline>`` when it loads. A warm P spare
(``dejavu up --prefill-spares N``) loads the same engines but registers with
nobody: nothing routes to it. Once the controller declared a P-node dead, the
supervisor calls ``assume`` (pipeline) on the spare, which registers in the
lost node's place; the frontends see it there and send it that place's prompts
at its own address. Taking the role costs neither a process start nor a model load.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from orchestrator.fault.client import ControllerClient
from orchestrator.serving.config import NodeConfig, Role
from orchestrator.serving.node import connect_controller
from orchestrator.serving.params import RequestError


class PrefillRole:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.standby = config.role is Role.PREFILL_SPARE
        self.controller: ControllerClient | None = connect_controller(config)
        self.lock = threading.Lock()

    def control(self, op: str, args: list[bytes]) -> bytes:
        """``standby``: b"1" while it holds no role; ``assume`` [pipeline]: take P-node
        ``pipeline``'s place."""
        if op == "standby":
            return b"1" if self.standby else b"0"
        if op != "assume":
            raise RequestError(f"a P-node has no op {op!r} (assume, standby)")
        if len(args) != 1:
            raise RequestError("op 'assume' needs peers = [pipeline]")
        pipeline = int(args[0])
        with self.lock:
            if not self.standby:
                raise RequestError("this P-node already holds a role")
            self.config = replace(self.config, role=Role.PREFILL, pipeline=pipeline)
            self.controller = connect_controller(self.config)
            self.standby = False
        return b""

    def check_serving(self) -> None:
        if self.standby:
            raise RequestError("this P spare is on standby (it holds no role)")

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
