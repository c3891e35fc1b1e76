"""A spawned child process answering commands over queues: the harness of the
multi-process tests (tests/pipeline/stage_procs.py, tests/fault/replica_procs.py)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Callable

COMMAND_TIMEOUT_S = 60.0


def serve(handlers: dict[str, Callable], close: Callable[[], None], inbox: mp.Queue,
          outbox: mp.Queue) -> None:
    """The child's side: answer each ``(command, *args)`` with ``(ok, value)`` until
    ``("close",)``, which runs ``close`` and returns."""
    while True:
        command, *args = inbox.get(timeout=COMMAND_TIMEOUT_S)
        if command == "close":
            close()
            outbox.put((True, None))
            return
        try:
            outbox.put((True, handlers[command](*args)))
        except Exception:
            outbox.put((False, traceback.format_exc()))


class Child:
    """A spawned role and its command queues."""

    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=target, args=(*args, self.inbox, self.outbox),
                                   daemon=True)
        self.process.start()

    def answer(self, timeout_s: float = COMMAND_TIMEOUT_S):
        ok, value = self.outbox.get(timeout=timeout_s)
        if not ok:
            raise RuntimeError(f"child {self.process.pid} failed:\n{value}")
        return value

    def call(self, *command, timeout_s: float = COMMAND_TIMEOUT_S):
        self.inbox.put(command)
        return self.answer(timeout_s)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):  # a dead or stuck child is killed below
                self.call("close", timeout_s=10)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
