"""Our `dejavu bench disagg` measurements drawn on the axes of the papers' own figures, with
the papers' published numbers on the same plot as labelled reference bars and lines.

    python scripts/paper_figures.py                      # every docs/disagg/emulated-*.csv
    python scripts/paper_figures.py --check              # print rows and ratios, write nothing
    python scripts/paper_figures.py docs/disagg/emulated-long-conv.csv code=my-run.csv

Writes into ``docs/disagg/figures/`` (``--out``):

- ``splitwise-fig16-<trace>.png``: TTFT p50/p99 and TBT p50/p99 (and p99 from the second
  token) against offered load, colocated against Splitwise's pools, from the rows of K = 8
  (``--time-scale``) runs on 8 machines (``--machines``) of that trace; compare Splitwise
  (ISCA 2024) Fig. 16.
- ``splitwise-fig18.png``: pools / colocated tokens/s and goodput at equal machines, and mixed
  pools (H100 prompt, A100 token machines) / colocated at equal cost, beside Splitwise's
  published ratios (abstract, Fig. 18).
- ``dejavu-fig12.png``: DejaVu's split (``R x (P_DP+T_DT)``) against the colocated pipeline
  (DejaVu's Baseline-X) in tokens/s and goodput, beside DejaVu (ICML 2024) Fig. 12's 1.88x
  and 2x.

A figure whose rows are absent is skipped with a message. Ratios pair a disaggregated row
with the colocated (or colocated-pipeline) row of the same file, trace and offered rate, so
both layouts served the same requests at the same arrivals.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file: `clients` and `orchestrator` live here
    sys.path.insert(0, str(ROOT))

DISAGG = ROOT / "docs" / "disagg"
FIGURES = DISAGG / "figures"
TRACES = ("conv", "code")
TRACE_NAMES = {"conv": "conversation", "code": "coding"}

# Splitwise's published ratios (throughput of its cluster over the baseline's).
# Each: (label, ratio); all from the paper's abstract and Fig. 18, or the text after Fig. 20.
SPLITWISE_RATIOS: list[tuple[str, float]] = [
    ("Splitwise abstract:\nthroughput at the same cost and power", 2.35),
    ("Splitwise Fig. 18, iso-power: Splitwise-AA\nvs Baseline-A100 (same power and cost)", 2.15),
    ("Splitwise abstract:\nthroughput at 20% lower cost", 1.4),
    ("Splitwise Fig. 18, iso-cost: Splitwise-AA\nvs Baseline-H100 (25% more power)", 1.4),
    ("Splitwise Fig. 18, iso-power:\nSplitwise-HA at 10% lower cost", 1.18),
    ("Splitwise, no strict SLO, high load: req/s per $\n"
     "(AA/A100 0.89 vs 0.89; HH/H100 0.75 vs 0.75)", 1.0),
]
DEJAVU_RATIOS: list[tuple[str, float]] = [
    ("DejaVu Fig. 12: OPT-66B, DejaVu-X-Y vs\nBaseline (FasterTransformer pipeline), up to", 1.88),
    ("DejaVu Fig. 12: BLOOM-176B, DejaVu-X-Y vs\nBaseline (FasterTransformer pipeline), up to",
     2.0),
]
# Splitwise Fig. 3: the traces' median prompt, for the unloaded reference lines.
MEDIAN_PROMPT = {"code": 1500, "conv": 1020}

POOLS = re.compile(r"^(\d+)P\+(\d+)T(?: pools)?$")
MIXED = re.compile(r"^(\d+)P (\S+) \+ (\d+)T (\S+)$")  # "2P H100 + 12T A100"
SPLIT = re.compile(r"^(\d+)x \(P(\d+)\+T(\d+)\)$")  # DejaVu's "2x (P1+T3)"
COLOCATED = re.compile(r"^(\d+)x colocated$")
PIPELINE = re.compile(r"^(?:(\d+)x )?colocated depth (\d+)$")  # "2x colocated depth 4"


@dataclass
class Row:
    """One CSV row of `dejavu bench disagg`; columns an older file lacks read as NaN/''."""

    file: str
    line: int  # in the file, header = 1
    trace: str
    order: int  # position among every row read: later files win ties
    values: dict[str, str] = field(default_factory=dict)

    def num(self, key: str, default: float = math.nan) -> float:
        try:
            return float(self.values.get(key, ""))
        except ValueError:
            return default

    @property
    def mode(self) -> str:
        return self.values.get("mode", "")

    @property
    def layout(self) -> str:
        return self.values.get("layout", "")

    @property
    def rate(self) -> float:
        return self.num("rate_rps")

    @property
    def time_scale(self) -> float:
        return self.num("time_scale", 1.0)  # files before the column ran unscaled

    def where(self) -> str:
        return f"{self.file}:{self.line} {self.mode} '{self.layout}' @ {self.rate:g} req/s"


def machines_of(layout: str) -> int | None:
    """Machines a layout label names, None when it names none the script knows."""
    if m := COLOCATED.match(layout):
        return int(m[1])
    if m := POOLS.match(layout):
        return int(m[1]) + int(m[2])
    if m := MIXED.match(layout):
        return int(m[1]) + int(m[3])
    if m := SPLIT.match(layout):
        return int(m[1]) * (int(m[2]) + int(m[3]))
    if m := PIPELINE.match(layout):
        return int(m[1] or 1) * int(m[2])
    return None


def trace_of(name: str) -> str | None:
    found = [t for t in TRACES if t in Path(name).name]
    return found[0] if len(found) == 1 else None


def read_runs(specs: Sequence[str]) -> list[Row]:
    """Rows of every ``PATH`` or ``TRACE=PATH`` (the trace from a file name holding exactly
    one of conv/code when not given); a file without a trace is skipped with a message."""
    rows: list[Row] = []
    for spec in specs:
        trace, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        trace = trace or trace_of(path) or ""
        if trace not in TRACES:
            print(f"skipped {path}: no trace in its name; pass conv={path} or code={path}")
            continue
        with open(path, newline="") as f:
            for line, values in enumerate(csv.DictReader(f), start=2):
                rows.append(Row(Path(path).name, line, trace, len(rows), dict(values)))
    return rows


@dataclass(frozen=True)
class Ratio:
    """A disaggregated row over its baseline of the same file, trace and offered rate."""

    kind: str  # "equal machines", "equal cost" (mixed machines) or "pipeline" (DejaVu)
    trace: str
    file: str
    rate_rps: float
    load: float  # the offered rate over the baseline's predicted capacity
    layout: str
    baseline: str
    tokens: float  # tokens/s ratio
    goodput: float
    cost: float  # cost per hour ratio (NaN where the file has no cost column)
    tbt_running_p99: float
    tokens_per_s: tuple[float, float]  # (ours, baseline)
    rows: tuple[Row, Row]  # (disaggregated, baseline)


def _div(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) else math.nan


def cost_per_hour(row: Row) -> float:
    # The bench writes cost per request = cost per hour / 3600 / token_rps: undo it.
    return row.num("cost_per_request") * 3600 * row.num("token_rps")


def kind_of(row: Row, baseline: Row) -> str | None:
    if MIXED.match(row.layout):
        return "equal cost"
    if POOLS.match(row.layout) and machines_of(row.layout) == machines_of(baseline.layout):
        return "equal machines"
    if SPLIT.match(row.layout):
        return "pipeline"
    return None


def newest(rows: Iterable[Row]) -> Row:
    """The row taken last: by the bench's date column, then by the order given."""
    return max(rows, key=lambda r: (r.values.get("date", ""), r.order))


def ratios(rows: Sequence[Row]) -> list[Ratio]:
    """Every disaggregated row against its baseline in the same file at the same rate:
    Splitwise's pools (same machines) and mixed pools (equal cost) against ``colocated``,
    DejaVu's split against ``colocated-pipeline``."""
    groups: dict[tuple[str, str, float], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.file, r.trace, round(r.rate, 6)), []).append(r)
    out: list[Ratio] = []
    for (file, trace, rate), group in groups.items():
        bases = {mode: newest(g) for mode in ("colocated", "colocated-pipeline")
                 if (g := [r for r in group if r.mode == mode])}
        for r in group:
            if r.mode != "disaggregated":
                continue
            base = bases.get("colocated-pipeline" if SPLIT.match(r.layout) else "colocated")
            kind = kind_of(r, base) if base else None
            if not base or not kind:
                continue
            out.append(Ratio(
                kind=kind, trace=trace, file=file, rate_rps=rate,
                load=_div(rate, base.num("predicted_rps")), layout=r.layout,
                baseline=base.layout,
                tokens=_div(r.num("tokens_per_s"), base.num("tokens_per_s")),
                goodput=_div(r.num("goodput_rps"), base.num("goodput_rps")),
                cost=_div(cost_per_hour(r), cost_per_hour(base)),
                tbt_running_p99=_div(r.num("tbt_p99_running_ms"),
                                     base.num("tbt_p99_running_ms")),
                tokens_per_s=(r.num("tokens_per_s"), base.num("tokens_per_s")),
                rows=(r, base)))
    return sorted(out, key=lambda q: (q.kind, q.trace, q.rate_rps, q.file, q.layout))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    from clients.provenance import save_figure

    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)


def fig16_rows(rows: Sequence[Row], trace: str, machines: int, time_scale: float
               ) -> dict[str, list[Row]]:
    """The colocated and the pools rows of one trace on ``machines`` at ``time_scale``,
    by series label."""
    series: dict[str, list[Row]] = {}
    for r in rows:
        if (r.trace != trace or not math.isclose(r.time_scale, time_scale)
                or machines_of(r.layout) != machines):
            continue
        if r.mode == "colocated" and COLOCATED.match(r.layout):
            label = f"{r.layout} (Splitwise's Baseline-H100)"
        elif r.mode == "disaggregated" and POOLS.match(r.layout):
            label = f"{r.layout} (Splitwise-HH, no mixed pool)"
        else:
            continue
        series.setdefault(label, []).append(r)
    return series


PANELS = [("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"),
          ("tbt_p50_ms", "TBT p50 (ms)"), ("tbt_p99_ms", "TBT p99 (ms)"),
          ("tbt_p99_running_ms", "TBT p99 from the 2nd token (ms)")]

PAPER_NOTES = {
    "code": "Splitwise Fig. 16, coding (simulated iso-power clusters):\n"
            "Splitwise-HH, -HHcap and -AA beat Baseline-H100;\n"
            "as load rises Baseline-H100's TBT degrades, its mixed\n"
            "batches holding large prompts (ours: colocated TBT p99).\n"
            "Fig. 17 loads: 70 req/s (low), 130 req/s (high).\n"
            "Fig. 12: Splitwise-HH for 70 req/s at least cost:\n"
            "27 prompt + 3 token machines.",
    "conv": "Splitwise Fig. 16, conversation (simulated iso-power\n"
            "clusters): tokens run long, Splitwise-HHcap is best on\n"
            "every metric; Splitwise-HA's mixed pool improves TBT at\n"
            "high load (its H100s join the mixed pool past 90 req/s).\n"
            "Fig. 17 loads: 70 req/s (low), 130 req/s (high).",
}


def references(profile: str, trace: str) -> dict[str, list[tuple[float, str]]]:
    """Splitwise's own measured H100 times (SplitwiseSim's perf model, the profile the
    emulated engine sleeps) at the trace's median prompt: reference lines per panel."""
    try:
        from orchestrator.profiles.profile import load_profile

        p = load_profile(profile)
    except (ImportError, OSError, ValueError) as exc:
        print(f"no reference lines: profile {profile}: {exc}")
        return {}
    prompt = MEDIAN_PROMPT[trace]
    ttft = [(p.prefill_s(prompt), f"unloaded prefill, median prompt {prompt} (Fig. 3)")]
    tbt = [(p.decode_s(1, prompt) * 1e3, "step at batch 1 (perf model)"),
           (p.decode_s(16, prompt) * 1e3, "step at batch 16 (our cap)"),
           (p.decode_s(64, prompt) * 1e3, "step at batch 64 (Fig. 5: < 2x batch 1)")]
    return {"ttft_p50_s": ttft, "ttft_p99_s": ttft, "tbt_p50_ms": tbt, "tbt_p99_ms": tbt,
            "tbt_p99_running_ms": tbt}


def fig16_lines(series: dict[str, list[Row]]) -> dict[str, tuple[list[Row], list[Row]]]:
    """Per series, the rows drawing its line (one per rate) and the other runs. At a rate
    several files measured, the line takes the newest file that ran both layouts, so the
    two lines at that rate compare one run's requests and window (a 30 s rerun of one
    layout beside a 60 s run of the other would not); else the newest row."""
    files: dict[float, dict[str, set[str]]] = {}
    for name, rs in series.items():
        for r in rs:
            files.setdefault(round(r.rate, 6), {}).setdefault(name, set()).add(r.file)
    lines: dict[str, tuple[list[Row], list[Row]]] = {}
    for name, rs in series.items():
        chosen: list[Row] = []
        for rate in sorted({round(r.rate, 6) for r in rs}):
            at = [r for r in rs if round(r.rate, 6) == rate]
            both = set.intersection(*files[rate].values()) if len(files[rate]) > 1 else set()
            paired = [r for r in at if r.file in both]
            chosen.append(newest(paired or at))
        lines[name] = (chosen, [r for r in rs if r not in chosen])
    return lines


def plot_fig16(series: dict[str, list[Row]], trace: str, machines: int, time_scale: float,
               profile: str, path: Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    every = [r for rs in series.values() for r in rs]
    panels = [(k, lab) for k, lab in PANELS if any(not math.isnan(r.num(k)) for r in every)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    refs = references(profile, trace)
    colocated = [r.num("predicted_rps") for r in every if r.mode == "colocated"]
    capacity = sorted(colocated)[len(colocated) // 2] if colocated else math.nan
    colors = ["tab:red", "tab:blue", "tab:green", "tab:purple"]
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    handles: dict[str, object] = {}
    # The baseline (colocated) first, in red; the pools after it.
    order = sorted(fig16_lines(series).items(), key=lambda kv: "colocated" not in kv[0])
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        for color, (name, (chosen, others)) in zip(colors, order, strict=False):
            (h,) = ax.plot([r.rate for r in chosen], [r.num(key) for r in chosen], "o-",
                           color=color)
            handles.setdefault(name, h)
            if others:  # how far a rerun at the same rate moved
                (h,) = ax.plot([r.rate for r in others], [r.num(key) for r in others], "o",
                               mfc="none", color=color, alpha=0.6)
                handles.setdefault(f"{name.split(' (')[0]}: other runs at that rate", h)
        for i, (value, text) in enumerate(refs.get(key, [])):
            h = ax.axhline(value, color="grey", ls=["--", ":", "-."][i % 3], lw=1)
            handles.setdefault(f"Splitwise data: {text}: {value:.3g}", h)
        if key != "tbt_p50_ms":  # tails span decades; the median step stays near 30-50 ms
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
            ax.tick_params(axis="y", which="minor", labelsize=7)
            label += ", log scale"
        ax.set_xlabel("offered load (req/s, profile time)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        if not math.isnan(capacity):
            top = ax.secondary_xaxis("top", functions=(lambda x: x / capacity,
                                                       lambda x: x * capacity))
            top.set_xlabel(f"load / colocated prediction ({capacity:.1f} req/s)", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # One legend and the paper's side of the comparison in the free panel.
    last = list(axes.flat)[-1]
    last.legend(list(handles.values()), list(handles), loc="upper left", fontsize=7,
                frameon=False)
    last.text(0.0, 0.47, PAPER_NOTES[trace] + "\n\nOurs: batch 16 per machine, no mixed "
              "pool, our SLO;\nE2E latency not measured. Files:\n"
              + ", ".join(sorted({r.file for r in every})).replace(".csv, ", ".csv,\n"),
              va="top", fontsize=7, transform=last.transAxes, family="monospace")
    fig.suptitle(f"ours ({machines} emulated H100, Splitwise Llama-2-70B profile, K = "
                 f"{time_scale:g}), {TRACE_NAMES[trace]} trace — compare Splitwise Fig. 16")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _fmt(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def ratio_label(q: Ratio) -> str:
    cost = f", cost/h {_fmt(q.cost)}" if not math.isnan(q.cost) else ""
    names = f"{dejavu_names(q)}:\n" if q.kind == "pipeline" else ""
    return (f"{names}{q.layout} vs {q.baseline}\n@ {q.rate_rps:g} req/s (load {q.load:.1f}x)"
            f"{cost}\n[{q.file}]")


def plot_ratios(paper: list[tuple[str, float]], ours: list[tuple[str, list[Ratio]]],
                title: str, path: Path) -> None:
    """Horizontal bars on one ratio axis: the paper's (grey, hatched) above ours (tokens/s
    and goodput per pair), grouped under headings, a line at 1.0."""
    plt = _pyplot()
    labels: list[tuple[float, str]] = []
    # y, value, color, hatch, legend, what the ratio is of
    bars: list[tuple[float, float, str, str, str, str]] = []
    y = 0.0
    headings: list[tuple[float, str]] = []
    headings.append((y, "paper (as published)"))
    for text, value in paper:
        y += 1
        labels.append((y, text))
        bars.append((y, value, "0.6", "//", "paper: throughput ratio", ""))
    for heading, qs in ours:
        y += 1.2
        headings.append((y, heading))
        for q in qs:
            y += 1.3
            labels.append((y, ratio_label(q)))
            ours_tok, base_tok = q.tokens_per_s
            ours_good, base_good = (r.num("goodput_rps") for r in q.rows)
            bars.append((y - 0.2, q.tokens, "tab:blue", "", "ours: tokens/s ratio",
                         f"{ours_tok:.0f} vs {base_tok:.0f} tok/s"))
            bars.append((y + 0.2, q.goodput, "tab:orange", "", "ours: goodput ratio",
                         f"{ours_good:.2f} vs {base_good:.3g} req/s"))
    fig, ax = plt.subplots(figsize=(13, 1.2 + 0.42 * y))
    # A ratio over a near-zero baseline goodput (a backlog that grew all run) would squash
    # every other bar: such bars stop at the axis' end with their value written out.
    end = max(3.0, min(6.0, max((b[1] for b in bars if not math.isnan(b[1])), default=1)))
    seen: set[str] = set()
    for by, value, color, hatch, legend, of in bars:
        if math.isnan(value):
            ax.text(0.02, by, f"n/a ({of})", va="center", fontsize=7)
            continue
        ax.barh(by, min(value, end), height=0.38 if color != "0.6" else 0.7, color=color,
                hatch=hatch, edgecolor="0.3", label=None if legend in seen else legend)
        seen.add(legend)
        text = f"{value:.2f}x" + (f" ({of})" if of else "")
        if value > end:
            ax.text(end - 0.03, by, f"off scale: {text}", va="center", ha="right",
                    fontsize=7, color="white", fontweight="bold")
        else:
            ax.text(value + 0.03, by, text, va="center", fontsize=7)
    for hy, text in headings:
        ax.text(0, hy, text, fontweight="bold", fontsize=9, va="center",
                transform=ax.get_yaxis_transform())
    ax.set_yticks([ly for ly, _ in labels], [lt for _, lt in labels], fontsize=7)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_ylim(y + 1, -1)
    ax.set_xlim(0, end * 1.12)
    ax.set_xlabel("ratio over the baseline (1.0 = same)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=10, loc="right")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def dejavu_names(q: Ratio) -> str:
    m, base = SPLIT.match(q.layout), machines_of(q.baseline)
    assert m
    r, dp, dt = (int(g) for g in m.groups())
    return f"DejaVu-{r * dp}-{r * dt} vs Baseline-{base}"


def print_rows(title: str, rows: Iterable[Row]) -> None:
    print(f"  rows ({title}):")
    for r in sorted(rows, key=lambda r: (r.file, r.line)):
        print(f"    {r.where()}")


def print_ratio(q: Ratio) -> None:
    print(f"    {q.kind:14} {q.trace} {q.layout!r} / {q.baseline!r} @ {q.rate_rps:g} req/s "
          f"({q.load:.2f}x) [{q.file}]: tok/s {_fmt(q.tokens)} goodput {_fmt(q.goodput)} "
          f"cost/h {_fmt(q.cost)} running TBT p99 {_fmt(q.tbt_running_p99)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="CSV files of `dejavu bench disagg`, as PATH "
                        "(the trace from the file name: it holds 'conv' or 'code') or "
                        "TRACE=PATH (conv or code). Rows of several files merge; where "
                        "several runs share a rate, Fig. 16's lines take the newest file "
                        "(date column, then the later file) that ran both layouts, the "
                        "others drawn hollow. Default: docs/disagg/emulated-*.csv")
    parser.add_argument("--out", type=Path, default=FIGURES, help="folder for the PNGs")
    parser.add_argument("--machines", type=int, default=8,
                        help="Fig. 16: rows of layouts on this many machines")
    parser.add_argument("--time-scale", type=float, default=8.0,
                        help="Fig. 16: rows of runs at this time scale K")
    parser.add_argument("--profile", default="splitwise-llama2-70b-h100",
                        help="Fig. 16's reference lines: the profile the runs slept")
    parser.add_argument("--check", action="store_true",
                        help="print the rows and ratios each figure uses; write nothing")
    args = parser.parse_args(argv)
    specs = args.runs or [str(p) for p in sorted(DISAGG.glob("emulated-*.csv"))]
    rows = read_runs(specs)
    found = ratios(rows)
    written: list[Path] = []

    for trace in TRACES:
        name = f"splitwise-fig16-{trace}.png"
        series = fig16_rows(rows, trace, args.machines, args.time_scale)
        if len(series) < 2:
            print(f"{name}: skipped, no colocated and pools rows of the {trace} trace on "
                  f"{args.machines} machines at K = {args.time_scale:g}")
            continue
        print(f"{name}:")
        for label, (chosen, others) in fig16_lines(series).items():
            print_rows(f"{label}, the line", chosen)
            if others:
                print_rows(f"{label}, other runs (hollow)", others)
        if not args.check:
            plot_fig16(series, trace, args.machines, args.time_scale, args.profile,
                       args.out / name)
            written.append(args.out / name)

    splitwise = [(f"ours at equal machines, {TRACE_NAMES[t]} (pools / colocated)",
                  [q for q in found if q.kind == "equal machines" and q.trace == t])
                 for t in TRACES]
    splitwise += [(f"ours at equal cost, {TRACE_NAMES[t]} (H100 prompt + A100 token pools / "
                   "colocated H100)",
                   [q for q in found if q.kind == "equal cost" and q.trace == t])
                  for t in TRACES]
    splitwise = [(h, qs) for h, qs in splitwise if qs]
    if splitwise:
        print("splitwise-fig18.png: ratios")
        for _, qs in splitwise:
            for q in qs:
                print_ratio(q)
        if not args.check:
            plot_ratios(SPLITWISE_RATIOS, splitwise,
                        "Splitwise Fig. 18 and abstract (paper: simulated clusters, throughput "
                        "at its SLOs)\nbeside ours (measured on emulated H100/A100 machines, "
                        "Splitwise Llama-2-70B profiles)",
                        args.out / "splitwise-fig18.png")
            written.append(args.out / "splitwise-fig18.png")
    else:
        print("splitwise-fig18.png: skipped, no disaggregated pools row paired with a "
              "colocated row at the same rate in one file")

    dejavu = [q for q in found if q.kind == "pipeline"]
    if dejavu:
        print("dejavu-fig12.png: ratios")
        for q in dejavu:
            print(f"    {dejavu_names(q)}")
            print_ratio(q)
        groups = [(f"ours, {TRACE_NAMES[t]}: DejaVu split / colocated pipeline "
                   "(Baseline-X)", [q for q in dejavu if q.trace == t]) for t in TRACES]
        if not args.check:
            plot_ratios(DEJAVU_RATIOS, [(h, qs) for h, qs in groups if qs],
                        "DejaVu Fig. 12 (paper: OPT-66B, BLOOM-176B on A100s, 'up to')\n"
                        "beside ours (measured, emulated): DejaVu-X-Y over Baseline-X",
                        args.out / "dejavu-fig12.png")
            written.append(args.out / "dejavu-fig12.png")
    else:
        print("dejavu-fig12.png: skipped, no colocated-pipeline row paired with a "
              "disaggregated 'R x (P_DP+T_DT)' row at the same rate in one file")

    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
