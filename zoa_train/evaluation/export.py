"""`zoa-train export CHECKPOINT OUT_DIR`: a trained language model (GPT-2, BERT, Llama, or a family of
one's own: zoa_train/models/registry.py) as a Hugging Face model directory.

OUT_DIR gets what `save_pretrained` writes for the model (config.json, model.safetensors,
generation_config.json for the causal LMs) and for the run's tokenizer, so that
`transformers.AutoModelForCausalLM` (GPT-2, Llama), `AutoModelForPreTraining` / `AutoModelForMaskedLM`
(BERT) and `AutoTokenizer.from_pretrained(OUT_DIR)` load it, and with them lm-evaluation-harness
(`--model hf --model_args pretrained=OUT_DIR`) and pipelines. Beside the model, zoa_export.json
records where it came from: source, checkpoint step, model kind and class, how many ranks were
averaged, zoa-train version.

CHECKPOINT is whatever `load_language_model` accepts: a run directory (its latest complete
checkpoint), a checkpoint directory, a model file, or an exported directory. A checkpoint taken
inside a 0/1 Adam local-step period holds each rank's own parameters: the export is their average,
and says so.

The directory is written into a temporary sibling and renamed into place at the end, so a failed
export leaves OUT_DIR as it was (absent, empty, or with --overwrite its previous contents).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from zoa_train.errors import UserError
from zoa_train.files import check_directory

RECORD = "zoa_export.json"


@dataclass
class ExportResult:
    out_dir: Path
    kind: str  # the model family (model.kind)
    architecture: str  # the transformers class, e.g. GPT2LMHeadModel
    auto_class: str  # the transformers Auto class that loads it, e.g. AutoModelForCausalLM
    step: int | None
    source: str
    averaged_ranks: int
    files: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes), sorted by name


def export_language_model(checkpoint: str | Path, out_dir: str | Path, overwrite: bool = False) -> ExportResult:
    """Write the model and tokenizer at `checkpoint` to `out_dir` (absent or empty, or anything with
    `overwrite`) with save_pretrained; every refusal is a one-sentence UserError raised before
    anything is written."""
    from zoa_train import __version__

    checkpoint, shown = Path(checkpoint), Path(out_dir)
    out_dir = shown.resolve()  # also gives "." a name and a parent to stage beside
    if not checkpoint.exists():
        raise UserError(f"checkpoint {checkpoint}: no such file or directory.")
    _check_destination(checkpoint, out_dir, shown, overwrite)

    from transformers.utils import logging as hf_logging

    from zoa_train.evaluation.checkpoints import load_language_model  # torch and transformers: after the cheap checks

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading and saving bars: the summary says what was written
    try:
        return _export(load_language_model(checkpoint), checkpoint, out_dir, shown, overwrite, __version__)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _export(loaded, checkpoint: Path, out_dir: Path, shown: Path, overwrite: bool, version: str) -> ExportResult:
    architecture = type(loaded.model).__name__
    source = Path(loaded.source).resolve()
    if loaded.averaged_ranks > 1:  # the ranks' files, not model.pt (rank 0's parameters), made the model
        source = source.parent
    record = {
        "source": str(source),
        "checkpoint_step": loaded.step,
        "model_kind": loaded.kind,
        "architecture": architecture,
        "averaged_ranks": loaded.averaged_ranks,
        "zoa_train_version": version,
    }

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".export-tmp", dir=out_dir.parent))
    except OSError as e:
        raise UserError(f"cannot write beside {shown}: {e.strerror or e}.") from None
    try:
        loaded.model.save_pretrained(staged)
        loaded.tokenizer.save_pretrained(staged)
        (staged / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _finish_tree(staged)
        _check_destination(checkpoint, out_dir, shown, overwrite)  # again: something may have appeared meanwhile
        _move_into_place(staged, out_dir)
    except OSError as e:
        shutil.rmtree(staged, ignore_errors=True)
        raise UserError(f"cannot write {shown}: {e.strerror or e}.") from None
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    files = sorted((str(p.relative_to(out_dir)), p.stat().st_size) for p in out_dir.rglob("*") if p.is_file())
    return ExportResult(shown, loaded.kind, architecture, loaded.auto_class, loaded.step, record["source"], loaded.averaged_ranks, files)


def _check_destination(checkpoint: Path, out_dir: Path, shown: Path, overwrite: bool) -> None:
    """`out_dir` (resolved; `shown` as the user wrote it) may be absent, empty, or with `overwrite` any
    directory that holds none of what the export reads."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output directory {shown} exists and is not a directory.")
    check_directory(shown, "output directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if any(out_dir == p or out_dir in p.parents for p in _read_paths(checkpoint)):
        raise UserError(f"output directory {shown} holds the checkpoint being exported or its run's files; choose another directory.")
    if not overwrite:
        raise UserError(f"output directory {shown} is not empty: pass --overwrite to replace its contents.")


def _read_paths(checkpoint: Path) -> list[Path]:
    """What exporting `checkpoint` reads (resolved): replacing a directory that holds one would destroy it."""
    if (checkpoint / "config.json").is_file():  # a Hugging Face directory
        return [checkpoint.resolve()]
    from zoa_train.train.rundir import resolve_model_file

    model_file, run = resolve_model_file(checkpoint)
    paths = [checkpoint, model_file, model_file.parent]  # the rank files beside model.pt
    if run is not None:
        from zoa_train.tasks.language import MODEL_CONFIG

        paths += [run.path / "recipe.yaml", run.path / "tokenizer", run.path / MODEL_CONFIG]
    return [p.resolve() for p in paths]


def _move_into_place(staged: Path, out_dir: Path) -> None:
    """Rename `staged` to `out_dir`; an existing `out_dir` is first renamed aside and only removed once
    the new directory is in place (and put back if that rename fails)."""
    if not out_dir.exists():
        os.rename(staged, out_dir)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".export-old", dir=out_dir.parent))
    os.rmdir(aside)
    os.rename(out_dir, aside)
    try:
        os.rename(staged, out_dir)
    except BaseException:
        os.rename(aside, out_dir)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _finish_tree(directory: Path) -> None:
    """Give the directory and its files the permissions of any new file (mkdtemp makes the directory
    private and safetensors its file) and fsync them, so the rename publishes complete files."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        if path.is_dir():
            os.chmod(path, 0o777 & ~umask)
        elif path.is_file():
            os.chmod(path, 0o666 & ~umask)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"


def export_command(
    checkpoint: Annotated[
        Path, typer.Argument(help="A run directory (its latest complete checkpoint), a checkpoint directory or a model file.", show_default=False)
    ],
    out_dir: Annotated[Path, typer.Argument(help="The Hugging Face model directory to write; absent or empty unless --overwrite.", show_default=False)],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT_DIR (only once the new export is complete).")] = False,
) -> None:
    """Write a language model's checkpoint (GPT-2, BERT, Llama) and its tokenizer as a Hugging Face model directory.

    The directory is what save_pretrained writes (for from_pretrained, pipelines, lm-evaluation-harness) plus zoa_export.json, its provenance; a checkpoint inside a local-step period exports the ranks' average."""
    from rich.table import Table

    from zoa_train import console as zoa_console

    result = export_language_model(checkpoint, out_dir, overwrite)
    console = zoa_console.out
    step = f"step {result.step}" if result.step is not None else "no recorded step"
    console.print(f"exported {result.architecture} ({step}) from {result.source} to {result.out_dir}", highlight=False, soft_wrap=True)
    if result.averaged_ranks > 1:
        console.print(
            f"the checkpoint lies inside a local-step period: the parameters of its {result.averaged_ranks} ranks differed and were averaged",
            highlight=False,
            soft_wrap=True,
        )
    table = Table(title=str(result.out_dir))
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in result.files:
        table.add_row(name, _size(size))
    console.print(table)
    console.print(f"load with transformers.{result.auto_class}.from_pretrained({str(result.out_dir)!r}) and AutoTokenizer", highlight=False, soft_wrap=True)
