"""zoa-train command line.

  zoa-train bench comm --sizes 1M,16M,64M --nproc 2      fp32 allreduce vs 1-bit allreduce
"""

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from zoa_train import __version__
from zoa_train.errors import UserError

app = typer.Typer(help="Communication-efficient distributed training with 0/1 Adam.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print ratios measured in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()


def fail(message: str) -> None:
    """Report bad input in one sentence and exit with code 2."""
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def _version(value: bool) -> None:
    if value:
        console.print(f"zoa-train {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Communication-efficient distributed training with 0/1 Adam."""


@bench_app.command("comm")
def bench_comm(
    sizes: Annotated[str, typer.Option(help="Comma-separated element counts (k, M, G suffixes). [default: 1M,16M,64M]")] = "1M,16M,64M",
    nproc: Annotated[int, typer.Option(help="Local ranks to start. [default: 2]")] = 2,
    backend: Annotated[str, typer.Option(help="gloo or nccl. [default: nccl with CUDA, else gloo]")] = "",
    repeats: Annotated[int, typer.Option(help="Timed repeats after warm-up; the median is reported. [default: 5]")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Time torch.distributed.all_reduce (fp32) against OneBitAllReduce on the same tensors."""
    from zoa_train.bench.comm import FEEDBACK_CALLS, parse_size, rank_main
    from zoa_train.distributed import launch_local

    try:
        numels = [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        fail(f"--sizes: {e}.")
    if nproc < 2:
        fail("--nproc must be at least 2: a 1-rank allreduce sends nothing.")
    if repeats < 1:
        fail("--repeats must be at least 1.")
    if backend not in ("", "gloo", "nccl"):
        fail(f"--backend must be gloo or nccl, not {backend!r}.")
    rows = launch_local(rank_main, nproc, numels, repeats, backend or None, nproc)[0]
    result = {"nproc": nproc, "backend": backend or "default", "repeats": repeats, "results": rows}
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"fp32 allreduce vs 1-bit allreduce, {nproc} ranks")
    for name in ("elements", "fp32 s", "1-bit s", "speed-up", "err 1 call", f"err mean {FEEDBACK_CALLS}", "pack+unpack GB/s", "add GB/s", "ratio"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            f"{r['numel']:,}",
            f"{r['allreduce_fp32_s']:.4f}",
            f"{r['onebit_s']:.4f}",
            f"{r['speedup']:.2f}x",
            f"{r['rel_error_one_call']:.3f}",
            f"{r[f'rel_error_mean_of_{FEEDBACK_CALLS}']:.4f}",
            f"{r['pack_unpack_gbps']:.1f}",
            f"{r['add_gbps']:.1f}",
            f"{r['pack_unpack_vs_add']:.2f}",
        )
    console.print(table)


def run() -> None:
    """Console entry point: user errors raised deep inside become one sentence and exit code 2."""
    try:
        app()
    except UserError as e:
        Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False)
        sys.exit(2)
