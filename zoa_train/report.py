"""`zoa-train report`: plots and a comparison table for finished (or running) run directories.

Writes into one output directory: loss.png (training and validation loss against step, wall-clock
time and bytes sent), bits_per_param.png, step_kinds.png (what each optimizer step did), memory.png
(each log window's peak memory, the maximum over ranks, where the runs logged it) and report.md (the
table and links to the images). Files of the same names are replaced.

Matplotlib is used through Figure objects, never pyplot: no GUI backend and no global state, so it
works headless and inside other programs alike.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FormatStrFormatter

from zoa_train.errors import UserError
from zoa_train.files import check_directory, make_directory
from zoa_train.optim import registry
from zoa_train.runs import RunLog, first_reaching, read_run
from zoa_train.step_kinds import FULL, LOCAL, LOW_RANK, ONEBIT, OUTER, STEP_KINDS, VARIANCE

# One colour per optimizer (its registry entry's), the same in every plot; runs of one optimizer
# differ by line style and marker.
LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P"]
KIND_COLOURS = {VARIANCE: "#c0392b", FULL: "#34495e", ONEBIT: "#27ae60", LOCAL: "#f5d76e", LOW_RANK: "#16a085", OUTER: "#8e44ad"}
MB = 1e6
GB = 1e9


@dataclass
class Report:
    markdown: str  # the table, as in report.md
    target: float | None  # the best common validation loss
    files: list[Path]  # report.md first, then the images
    notes: list[str]


def load_runs(paths: list[Path]) -> tuple[list[RunLog], list[str]]:
    """Read every run directory (one without metric records yet is bad input too) and import the
    modules its recipe lists, which register its optimizer's colour; a module that cannot be
    imported any more only costs that colour, said in the notes returned."""
    runs, notes = [read_run(p) for p in paths], []
    for run in runs:
        if not run.records:
            raise UserError(f"{run.path} has no metric records yet (metrics.jsonl is empty).")
        try:
            registry.import_modules(run.recipe.get("imports") or [], str(run.path / "recipe.yaml"))
        except UserError as e:
            notes.append(f"{e} Its optimizer is drawn in the default colour.")
    return runs, notes


def labels(runs: list[RunLog]) -> list[str]:
    """Run directory names, with the parent's name where two runs share one (e.g. a/seed0, b/seed0)."""
    names = [r.name for r in runs]
    return [n if names.count(n) == 1 else f"{r.path.parent.name}/{n}" for n, r in zip(names, runs)]


def styles(runs: list[RunLog]) -> list[dict]:
    """Matplotlib keyword arguments per run: the optimizer's colour, then the n-th style of that optimizer."""
    seen: dict[str, int] = {}
    out = []
    for run in runs:
        n = seen.get(run.optimizer, 0)
        seen[run.optimizer] = n + 1
        spec = registry.find(run.optimizer)
        colour = spec.colour if spec is not None else registry.OTHER_COLOUR
        out.append({"color": colour, "linestyle": LINE_STYLES[n % len(LINE_STYLES)], "marker": MARKERS[n % len(MARKERS)]})
    return out


def best_common_loss(runs: list[RunLog]) -> float | None:
    """The highest of the runs' final validation losses: the best loss that every run reaches."""
    finals = [r.final("val_loss") for r in runs if r.final("val_loss") is not None]
    return max(finals) if finals else None


def table(runs: list[RunLog], target: float | None) -> tuple[list[str], list[list[str]]]:
    """One row per run; bytes are cumulative per rank, bits/param the average over all steps so far."""
    columns = ["run", "optimizer", "steps", "final loss", "final val loss", "wall time (s)", "bits/param", "rounds", "MB sent/rank"]
    if target is not None:
        columns += [f"time to val {target:.3f} (s)", f"step at val {target:.3f}"]
    rows = []
    for label, run in zip(labels(runs), runs):
        row = [
            label,
            run.optimizer,
            fmt(run.final("step"), "{:,}"),
            fmt(run.final("loss"), "{:.3f}"),
            fmt(run.final("val_loss"), "{:.3f}"),
            fmt(run.final("wall_time"), "{:.1f}"),
            fmt(run.final("bits_per_param"), "{:.3f}"),
            fmt(run.final("rounds"), "{:,}"),
            fmt(run.final("bytes_sent"), "{:,.1f}", scale=1 / MB),
        ]
        if target is not None:
            reached = first_reaching(run, target)
            row += [fmt(reached and reached.get("wall_time"), "{:.1f}"), fmt(reached and reached["step"], "{:,}")]
        rows.append(row)
    return columns, rows


def fmt(value, spec: str, scale: float | None = None) -> str:
    return "-" if value is None else spec.format(value if scale is None else value * scale)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    right = ["---" if c in ("run", "optimizer") else "---:" for c in columns]
    lines = [columns, right, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


# ---- plots ------------------------------------------------------------------------------------


def plot_losses(runs: list[RunLog], path: Path) -> None:
    """Rows: training loss, validation loss. Columns: against step, wall-clock time, bytes sent."""
    axes_x = [("step", "step", 1.0), ("wall_time", "wall-clock time (s)", 1.0), ("bytes_sent", "bytes sent per rank (MB, log scale)", 1 / MB)]
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    grid = fig.subplots(2, 3, sharey="row")
    for label, run, style in zip(labels(runs), runs, styles(runs)):
        for column, (x_key, _, scale) in enumerate(axes_x):
            train = [r for r in run.series("loss") if x_key in r]
            grid[0, column].plot(
                [r[x_key] * scale for r in train], [r["loss"] for r in train], label=label, color=style["color"], linestyle=style["linestyle"], linewidth=1.5
            )
            val = [r for r in run.series("val_loss") if x_key in r]
            grid[1, column].plot([r[x_key] * scale for r in val], [r["val_loss"] for r in val], label=label, markersize=5, **style)
    for row, what in enumerate(["training loss", "validation loss"]):
        grid[row, 0].set_ylabel(f"{what} (cross-entropy, nats)")
        for column, (_, xlabel, _) in enumerate(axes_x):
            ax = grid[row, column]
            ax.set_xlabel(xlabel)
            ax.set_title(f"{what} vs {xlabel.split(' per rank')[0].split(' (')[0]}")
            ax.grid(alpha=0.3)
        grid[row, 2].set_xscale("log")  # 1-bit optimizers send 10-30x fewer bytes than adam: linear would squash them
    # One legend for all panels, outside them; the validation lines carry both line style and marker.
    fig.legend(handles=grid[1, 0].get_lines(), title="run", loc="outside right upper")
    fig.savefig(path, dpi=100)


def plot_bits(runs: list[RunLog], path: Path) -> None:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for label, run, style in zip(labels(runs), runs, styles(runs)):
        series = run.series("bits_per_param")
        ax.plot(
            [r["step"] for r in series], [r["bits_per_param"] for r in series], label=label, color=style["color"], linestyle=style["linestyle"], linewidth=1.8
        )
    ax.set_yscale("log", base=2)  # 16 (adam) down to well under 1 (0/1 Adam) on one readable axis
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 0.5, 1, 2, 4 ... rather than 2^-1
    ax.set_xlabel("step")
    ax.set_ylabel("bits per parameter per step\n(average over the steps so far, log scale)")
    ax.set_title("communication: bits per parameter")
    ax.grid(alpha=0.3)
    ax.legend(title="run", fontsize="small")
    fig.savefig(path, dpi=100)


def plot_memory(runs: list[RunLog], path: Path) -> list[str]:
    """Each log window's peak memory (mem_peak_bytes: the maximum over ranks) against step; returns notes on
    the runs without it, which are left out."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    notes, highest = [], 0.0
    for label, run, style in zip(labels(runs), runs, styles(runs)):
        series = run.series("mem_peak_bytes")
        if not series:
            notes.append(
                f"{label}: no mem_peak_bytes in metrics.jsonl (a run from before it was logged, or one with only its lifetime peak), left out of memory.png."
            )
            continue
        peaks = [r["mem_peak_bytes"] / GB for r in series]
        highest = max(highest, *peaks)
        ax.plot(
            [r["step"] for r in series],
            peaks,
            label=label,
            color=style["color"],
            linestyle=style["linestyle"],
            linewidth=1.8,
        )
    ax.set_ylim(0, 1.15 * highest)  # from zero: a peak is read against the whole of the memory
    ax.set_xlabel("step")
    ax.set_ylabel("peak memory of the log window (GB)\n(the rank with the most)")
    ax.set_title("memory: peak per log window, maximum over ranks")
    ax.grid(alpha=0.3)
    ax.legend(title="run", fontsize="small")
    fig.savefig(path, dpi=100)
    return notes


def step_kinds(run: RunLog) -> np.ndarray | None:
    """Index into STEP_KINDS per step (position 0 = step 1), -1 where unknown; None if the run never logged them.

    Each record's characters end at its own step, so a resumed run's repeated records simply overwrite.
    """
    logged = run.series("step_kinds")
    if not logged:
        return None
    index = {kind: i for i, kind in enumerate(STEP_KINDS)}
    kinds = np.full(max(r["step"] for r in logged), -1, dtype=np.int8)
    for r in logged:
        chars = r["step_kinds"]
        kinds[r["step"] - len(chars) : r["step"]] = [index.get(c, -1) for c in chars]
    return kinds


def plot_step_kinds(runs: list[RunLog], path: Path) -> list[str]:
    """One row per run, one cell per step, coloured by kind; returns notes on runs without step_kinds."""
    names = labels(runs)
    per_run = [step_kinds(r) for r in runs]
    notes = [
        f"{name}: no step_kinds in metrics.jsonl (a run from before they were logged), left blank." for name, kinds in zip(names, per_run) if kinds is None
    ]
    steps = max((len(k) for k in per_run if k is not None), default=1)
    grid = np.full((len(runs), steps), -1, dtype=np.int8)
    for row, kinds in enumerate(per_run):
        if kinds is not None:
            grid[row, : len(kinds)] = kinds
    fig = Figure(figsize=(12, 1.6 + 0.45 * len(runs)), layout="constrained")
    ax = fig.subplots()
    cmap = ListedColormap([KIND_COLOURS[k] for k in STEP_KINDS])
    # Nearest-neighbour: kinds are categories and must not be blended when many steps share a pixel
    # (with far more steps than pixels each pixel then shows one of its steps).
    ax.imshow(
        np.ma.masked_less(grid, 0),
        cmap=cmap,
        vmin=-0.5,
        vmax=len(STEP_KINDS) - 0.5,
        aspect="auto",
        interpolation="nearest",
        extent=(0.5, steps + 0.5, len(runs) - 0.5, -0.5),
    )
    for row, kinds in enumerate(per_run):
        if row:
            ax.axhline(row - 0.5, color="white", linewidth=3)  # runs apart at a glance
        if kinds is None:
            ax.text(steps / 2, row, "no step_kinds logged (older run)", ha="center", va="center", color="#777777", fontsize="small")
    ax.set_yticks(range(len(runs)), names)
    ax.set_xlabel("step")
    ax.set_title("what each optimizer step did")
    present = {int(k) for k in np.unique(grid) if k >= 0}
    handles = [Patch(color=KIND_COLOURS[k], label=f"{k}: {text}") for i, (k, text) in enumerate(STEP_KINDS.items()) if i in present]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    fig.savefig(path, dpi=100)
    return notes


# ---- the whole report -------------------------------------------------------------------------


def write_report(paths: list[Path], out: Path) -> Report:
    check_directory(out, "report directory")  # before reading the runs
    runs, notes = load_runs(paths)
    target = best_common_loss(runs)
    columns, rows = table(runs, target)
    markdown = markdown_table(columns, rows)
    make_directory(out, "report directory")
    images = {"loss.png": "Loss", "bits_per_param.png": "Bits per parameter", "step_kinds.png": "Step kinds"}
    plot_losses(runs, out / "loss.png")
    plot_bits(runs, out / "bits_per_param.png")
    notes += plot_step_kinds(runs, out / "step_kinds.png")
    if any(run.series("mem_peak_bytes") for run in runs):
        images["memory.png"] = "Peak memory"
        notes += plot_memory(runs, out / "memory.png")

    text = ["# zoa-train report", "", "Runs: " + ", ".join(f"`{r.path}`" for r in runs), "", markdown]
    text.append(
        "Bits/param is the average over all steps; MB sent/rank is cumulative. "
        + (
            f"Time to val {target:.3f}: the highest of the runs' final validation losses, i.e. the best loss every run "
            "reaches; the wall time and step of each run's first validation at or below it."
            if target is not None
            else "No run logged a validation loss, so there is no time to a common loss."
        )
    )
    text.append("")
    for name, title in images.items():
        text += [f"![{title}]({name})", ""]
    text += [f"- {note}" for note in notes]
    report_md = out / "report.md"
    report_md.write_text("\n".join(text).rstrip() + "\n")
    return Report(markdown, target, [report_md, *(out / name for name in images)], notes)
