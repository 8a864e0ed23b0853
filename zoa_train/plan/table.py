"""`zoa-train plan` printed: a column per optimizer and variant, rows of counts, bytes, times and memory
(what zoa_train/plan/model.py computes)."""

from collections.abc import Callable

from rich.table import Table

from zoa_train.comm import registry as collectives
from zoa_train.optim import registry
from zoa_train.plan.model import variants
from zoa_train.plan.units import format_bytes


def _seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1 or s == 0:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3f} ms"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}x" if base else "-"


def format_plan(result: dict[str, dict]) -> Table:
    """The optimizers side by side (the 1-bit ones flat and node-aware, and each shardable one sharded,
    where a plan has them), with ratios against Adam (HSDP for the sharded columns) and, given a step
    time, predicted times and speed-ups, for the CLI to print."""
    names = [name for name in registry.names() if name in result]
    title = f"Communication plan, {result[names[0]]['steps']:,} steps"
    notes = [spec.plan_note(result[spec.name]) for spec in map(registry.get, names) if spec.plan_note is not None]
    adam = result.get(registry.BASELINE)
    several = any(len(list(variants(result[name]))) > 1 for name in names)
    labels = {c.name: c.title for c in collectives.specs()} | {"sharded": "sharded"}
    labels[collectives.default().name] = labels[collectives.default().name] if several else ""  # alone, the column needs no name
    columns, sharded = [], set()
    for name in names:
        for key, record in variants(result[name]):
            columns.append((name, record, labels[key]))
        if "sharded" in result[name]:
            sharded.add(id(result[name]["sharded"]))
    base = lambda r: adam["sharded"] if id(r) in sharded else adam  # noqa: E731
    rows = [
        ("|T_v| (variance updates)", lambda r: f"{r['variance_updates']:,}"),
        ("rounds", lambda r: f"{r['rounds']:,}"),
        ("syncs", lambda r: f"{r['syncs']:,}"),
        ("bits / param / step", lambda r: f"{r['bits_per_param']:.3f}"),
        ("bytes / rank", lambda r: format_bytes(r["bytes_per_rank"])),
    ]
    if several:
        rows.append(("bytes over each node's link", lambda r: format_bytes(r["inter_bytes_per_node"])))
        rows.append(("bytes / rank inside the node", lambda r: format_bytes(r["intra_bytes_per_rank"])))
    rows.append(("predicted comm time", lambda r: _seconds(r["comm_time_s"])))
    if adam:
        rows += [
            ("rounds vs Adam", lambda r: _ratio(r["rounds"], base(r)["rounds"])),
            ("bits vs Adam", lambda r: _ratio(r["bits_per_param"], base(r)["bits_per_param"])),
            ("bytes vs Adam", lambda r: _ratio(r["bytes_per_rank"], base(r)["bytes_per_rank"])),
            ("comm time vs Adam", lambda r: _ratio(r["comm_time_s"], base(r)["comm_time_s"])),
        ]
    if "step_time_s" in result[names[0]]:
        rows += [
            ("predicted step time", lambda r: _seconds(r["step_time_s"])),
            ("predicted time to train", lambda r: _seconds(r["total_time_s"])),
            ("speed-up vs Adam", lambda r: f"{r['speedup_vs_adam']:.2f}x" if r.get("speedup_vs_adam") else "-"),
            ("speed-up vs 1-bit Adam", lambda r: f"{r['speedup_vs_onebit_adam']:.2f}x" if r.get("speedup_vs_onebit_adam") else "-"),
        ]
    if sharded:
        notes.append("sharded: FSDP2 over each node's ranks, each rank exchanging its shard between nodes, compared with Adam sharded (HSDP)")
    memory_rows, memory_notes = _memory_rows(columns)
    caption = "; ".join(notes + memory_notes) or None
    return optimizer_table(title, caption, columns, rows + memory_rows)


def _memory_rows(columns: list[tuple]) -> tuple[list[tuple[str, Callable[[dict], str]]], list[str]]:
    """The rows of memory per rank (each column's: sharded in the sharded ones) and the notes they
    need, for format_plan's columns."""
    planned = [record["memory_per_rank"] for _, record, _ in columns if record.get("memory_per_rank")]
    if not planned:
        return [], []
    notes = []
    unplanned = dict.fromkeys(registry.get(name).title for name, record, _ in columns if not record.get("memory_per_rank"))
    if unplanned:
        notes.append(f"memory not planned for {', '.join(unplanned)}")

    def cell(figure):
        return lambda r: figure(r["memory_per_rank"]) if r.get("memory_per_rank") else "-"

    rows = [
        ("params + grads / rank", cell(lambda m: format_bytes(m["params"] + m["grads"]))),
        ("optimizer state / rank", cell(lambda m: format_bytes(m["optimizer_state"]))),
        ("comm scratch / rank", cell(lambda m: format_bytes(m["scratch"]))),
    ]
    units = [m for m in planned if "fsdp_unit" in m]
    if units:
        rows.append(("FSDP2 unit unsharded", cell(lambda m: format_bytes(m["fsdp_unit"]) if "fsdp_unit" in m else "-")))
        notes.append(
            f"FSDP2's largest unit {units[0]['fsdp_unit_is']}: {units[0]['fsdp_unit_params'] / 1e6:,.1f}M params, their fp32 params and grads unsharded at once"
        )
    counted = "activations" in planned[0]
    if counted:
        rows += [
            (f"activations ({mode})", cell(lambda m, mode=mode: format_bytes(m["activations_by_mode"][mode]))) for mode in planned[0]["activations_by_mode"]
        ]
    rows.append(("memory / rank", cell(lambda m: format_bytes(m["total"]))))
    if "fits" in planned[0]:
        size = format_bytes(planned[0]["total"] + planned[0]["headroom"])
        rows.append(
            (f"fits in {size}", cell(lambda m: f"yes, {format_bytes(m['headroom'])} left" if m["fits"] else f"no, {format_bytes(-m['headroom'])} over"))
        )
        if counted:
            rows.append(("fits with checkpointing", cell(lambda m: m["fits_with"] or "no mode")))
    if counted:
        notes.append(
            "memory / rank: fp32 params, grads, optimizer state, comm scratch and the activations of one micro-batch under the recipe's "
            "train.activation_checkpointing (each mode's in its row)"
        )
    else:
        notes.append("memory / rank: fp32 params, grads, optimizer state and comm scratch, activations not counted")
    return rows, notes


def optimizer_table(title: str, caption: str | None, columns: list[tuple], lines: list[tuple[str, Callable[[dict], str]]]) -> Table:
    """Optimizers side by side: one column per (optimizer name, its record[, its sync topology]), one
    row per (label, cell formatter)."""
    table = Table(title=title, caption=caption)
    table.add_column("")
    for name, _, *topology in columns:
        variant = f" ({topology[0]})" if topology and topology[0] else ""
        table.add_column(registry.get(name).title + variant, justify="right")
    for label, cell in lines:
        table.add_row(label, *(cell(record) for _, record, *_ in columns))
    return table
