"""What the benches and the cluster tests share: their prompts, the single-process reference
they check tokens against, a dummy model folder, running on one machine's cores, CSV and
markdown output of result rows (dicts or dataclasses), and what each process group holds
(from /proc)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from clients.provenance import provenance
from orchestrator.cluster.devices import Devices

PROMPTS = [
    "The quick brown fox",
    "Where is the server?",
    "A pipeline splits the layers of a model into stages",
    "0, 1, 2, 3",
    "How many tokens per second",
    "Large language models answer a prompt in two phases.",
    "Once upon a time",
    "Token by token, the answer grows",
]


def reference(model_dir: Path, prompts: list[str], max_tokens: int, max_seq_len: int,
              eos_id: int | None = None) -> list[list[int]]:
    """Greedy tokens of the single-process reference on the same weights (``eos_id``: each
    ends at that token, as a request with ``end_id`` does)."""
    from orchestrator.engine.reference import generate
    from orchestrator.engine.tokenizer import load_tokenizer
    from orchestrator.engine.torch_engine import load_engine

    tokenizer = load_tokenizer(model_dir)
    engine = load_engine(model_dir, max_seq_len=max_seq_len)
    return generate([engine], [tokenizer.encode(p).ids for p in prompts], max_tokens, eos_id)


def model_arguments(parser: argparse.ArgumentParser, arch: str, preset: str) -> None:
    """A bench's model: ``--model`` (a checkpoint folder), else a dummy ``--arch``
    ``--preset`` one (:func:`dummy_model`)."""
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: a dummy one)")
    parser.add_argument("--arch", default=arch, choices=["gpt2", "opt", "llama"],
                        help="the dummy model's architecture")
    parser.add_argument("--preset", default=preset, help="the dummy model's size (tiny, small, "
                        "...)")


def dummy_model(folder: Path, arch: str, preset: str) -> Path:
    """A seeded dummy checkpoint in ``folder/<arch>-<preset>`` (made once, then reused)."""
    from orchestrator.engine.checkpoint import make_checkpoint

    folder = folder / f"{arch}-{preset}"
    return folder if (folder / "config.json").is_file() else make_checkpoint(arch, preset, folder)


@contextmanager
def on_machine(machine: Devices | None) -> Iterator[None]:
    """Run this thread as a node on ``machine`` runs: on its cores, torch threads to match
    (None: where it runs now)."""
    import torch

    if machine is None:
        yield
        return
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    machine.pin()
    torch.set_num_threads(machine.threads or threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Machines:
    """``--pin``: a T-node's own core (the last), and the cores of everything else."""

    token: Devices
    host: Devices

    @classmethod
    def of_this_host(cls) -> Machines:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise ValueError(f"--pin needs two cores or more, this process has {cores}")
        return cls(Devices("cpu", (cores[-1],)), Devices("cpu", tuple(cores[:-1])))


def _as_dict(row) -> dict:
    return dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row)


def write_csv(path: Path, rows: list) -> None:
    """One line per row, the first row's fields as the header, then the run's ``date`` and
    ``commit`` (:func:`clients.provenance.provenance`) on every row."""
    dicts = [_as_dict(r) | provenance() for r in rows]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dicts[0]))
        writer.writeheader()
        writer.writerows(dicts)


def fmt(value) -> str:
    """A table cell: 3 significant digits below 10, whole numbers above, ``-`` for NaN."""
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def markdown(rows: list, columns: dict[str, str]) -> str:
    """A markdown table of ``rows``: ``columns`` maps each field to its header."""
    dicts = [_as_dict(r) for r in rows]
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(fmt(d[key]) for key in columns) + " |" for d in dicts]
    return "\n".join(lines)


def print_table(title: str, rows: list, columns: dict[str, str], width: int = 200) -> None:
    """``rows`` on the terminal (rich): ``columns`` maps each field to its header."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for header in columns.values():
        table.add_column(header, justify="right")
    for row in map(_as_dict, rows):
        table.add_row(*(fmt(row[key]) for key in columns))
    Console(width=width).print(table)


def metric(address: str, name: str, **labels: str) -> float:
    """Sum of a counter or gauge on a node's Prometheus port (``host:port``) over the series
    matching ``labels``."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _live_processes() -> Iterator[tuple[int, list[str]]]:
    """Every process this user can read: (pid, its /proc stat fields after the name); a
    zombie (killed, not reaped yet) holds nothing and is left out."""
    from orchestrator.cluster.tritonserver import proc_stat

    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = proc_stat(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if stat[0] != "Z":
            yield int(entry.name), stat


def process_groups() -> dict[int, dict[str, int]]:
    """Per process group (a node's tritonserver and its stubs), from /proc: resident memory
    (``rss_kb``), ``threads``, open ``fds`` and ``processes``."""
    groups: dict[int, dict[str, int]] = {}
    for pid, stat in _live_processes():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # gone meanwhile, or not ours to read
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        group = groups.setdefault(int(stat[2]),
                                  {"rss_kb": 0, "threads": 0, "fds": 0, "processes": 0})
        group["rss_kb"] += int(fields.get("VmRSS", "0 kB").split()[0])
        group["threads"] += int(fields["Threads"])
        group["fds"] += fds
        group["processes"] += 1
    return groups


def cpu_seconds(pgids: set[int]) -> float:
    """CPU time (user + system, and that of their reaped children) of every live process in
    the process groups ``pgids``, from /proc: a sleeping thread adds nothing."""
    tick = os.sysconf("SC_CLK_TCK")
    # stat fields after the name: [state, ppid, pgrp, ...]; utime, stime, cutime, cstime
    # are fields 14-17 of the whole line, so 11-14 here.
    return sum(sum(int(v) for v in stat[11:15]) for _, stat in _live_processes()
               if int(stat[2]) in pgids) / tick


def host_busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole host since boot, every core, from /proc/stat:
    differences over a run give how many cores were busy on average, whoever used them."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass
class CpuUse:
    """What a run cost the host's CPUs (:class:`CpuMeter`)."""

    wall_s: float
    cluster_cpu_s: float  # every process group of the cluster
    host_busy_cores: float  # mean busy cores, every process on the host
    load_avg: float  # mean 1-minute load average over the run
    cores: int

    @property
    def cluster_cores(self) -> float:
        return self.cluster_cpu_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def cpu_bound(self) -> bool:
        """The rule: the cluster alone kept more than half the cores busy, or the host (any
        process, other users' included) more than 80% of them. Past that, runnable threads
        wait for a core, and that wait adds to the latencies the engine's sleeps make."""
        return self.cluster_cores > 0.5 * self.cores or self.host_busy_cores > 0.8 * self.cores


class CpuMeter:
    """Measures a run's CPU: ``with CpuMeter(pgids) as meter: ...`` then ``meter.use``. A
    thread samples the load average each ``every_s`` seconds (it needs no CPU between)."""

    def __init__(self, pgids: set[int], every_s: float = 1.0) -> None:
        self.pgids, self.every_s = pgids, every_s
        self.loads: list[float] = []
        self._stop = threading.Event()
        self.use: CpuUse | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> CpuMeter:
        self._start = (time.perf_counter(), cpu_seconds(self.pgids), host_busy_jiffies())
        self.loads = [os.getloadavg()[0]]
        self._thread = threading.Thread(target=self._sample, name="cpu-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        wall0, cpu0, (busy0, total0) = self._start
        wall, (busy, total) = time.perf_counter() - wall0, host_busy_jiffies()
        cores = os.cpu_count() or 1
        self.use = CpuUse(wall_s=wall, cluster_cpu_s=cpu_seconds(self.pgids) - cpu0,
                          host_busy_cores=cores * (busy - busy0) / max(1, total - total0),
                          load_avg=sum(self.loads) / len(self.loads), cores=cores)
