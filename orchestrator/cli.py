"""The ``dejavu`` command: a table of subcommands, each imported only when used.

Every entry names ``module:function``; the function takes the remaining argv
and returns an exit code, building its own ``argparse`` parser with
``prog="dejavu <words>"``.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading

REPORT_MODULES = ("rich", "matplotlib")  # the ``bench`` extra: not installed on serving nodes
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("model", "make"): ("orchestrator.engine.checkpoint:main", "write a dummy checkpoint folder"),
    ("run",): ("orchestrator.engine.reference:main", "generate in one process (reference)"),
    ("up",): ("orchestrator.cluster.launcher:up_main", "start a local cluster of tritonservers"),
    ("status",): ("orchestrator.cluster.launcher:status_main", "show the local cluster"),
    ("down",): ("orchestrator.cluster.launcher:down_main", "stop the local cluster"),
    ("repo",): ("orchestrator.cluster.container:repo_main", "write one node's model repository"),
    ("node",): ("orchestrator.cluster.container:node_main", "be one node (in a container)"),
    ("supervise",): ("orchestrator.cluster.container:supervise_main",
                     "connect and recover token pipelines (containers)"),
    ("chaos",): ("orchestrator.cluster.chaos:main", "list or kill a local cluster's processes"),
    ("generate",): ("clients.generate:main", "generate through Triton HTTP/gRPC"),
    ("plan",): ("orchestrator.planner.cli:plan_main", "size prompt and token pools"),
    ("simulate",): ("orchestrator.planner.cli:simulate_main", "simulate serving policies"),
    ("profile",): ("orchestrator.engine.measure:main",
                   "measure the torch engine into an engine profile file"),
    ("bench", "kv"): ("benchmarks.kv:main", "KV streaming ablation (Fig. 11)"),
    ("bench", "recovery"): ("benchmarks.recovery:main", "failure recovery (Fig. 14, 15)"),
    ("bench", "pipeline"): ("benchmarks.pipeline:main", "pipeline bubbles and swapping"),
    ("bench", "soak"): ("benchmarks.soak:main", "mixed load while every role is killed in turn"),
    ("bench", "serving"): ("clients.perf:main",
                          "perf_analyzer, genai-perf and aiperf vs the bare engine"),
    ("bench", "disagg"): ("clients.disagg:main", "disaggregated vs colocated, equal devices"),
}


def _usage() -> str:
    lines = ["usage: dejavu COMMAND [ARGS...]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM as an exit, so that a killed bench takes its cluster down (the default
        # action skipped every cleanup and left 8 nodes serving nobody).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, func_name = target.split(":")
            try:
                func = getattr(importlib.import_module(module_name), func_name)
            except ModuleNotFoundError as exc:
                if exc.name not in REPORT_MODULES:
                    raise
                print(f"dejavu {' '.join(words)} reports with {exc.name}: install the bench "
                      "extra (pip install -e '.[bench]')", file=sys.stderr)
                return 2
            return int(func(argv[len(words) :]) or 0)
    print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
