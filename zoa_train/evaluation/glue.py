"""`zoa-train eval glue`: fine-tune a BERT checkpoint on GLUE tasks and score it on their dev splits.

Protocol ("glue dev, fine-tuned"): for each task the checkpoint's BERT encoder is copied into a
fresh `transformers.BertForSequenceClassification` (a classifier on the pooled [CLS] vector; one
output, trained with the mean squared error, for STS-B), fine-tuned with plain torch.optim.AdamW
and evaluated on the whole dev split. Defaults follow BERT's and Hugging Face run_glue's: lr 2e-5,
3 epochs, batch 32 (sequences per step over all ranks), seq_len 128 (pairs truncated longest
first), 10% linear warm-up then linear decay to 0, weight decay 0.01 (not on biases and LayerNorm
weights, as BERT and the Hugging Face Trainer do), gradient norm clipped at 1.0, seed 0; each is a
`--set finetune.KEY=VALUE` override checked like a recipe key. `--seeds K` fine-tunes K times
(seeds seed .. seed+K-1, a new classifier head each time) and reports each metric's median over
the K runs (the mean of the two middle runs when K is even), as GLUE papers do for the small tasks.

Pooler: a checkpoint trained with the next-sentence head (BertForPreTraining, or a Hugging Face
directory whose weights hold one) brings its pooler; a masked-LM-only model has none, so the
pooler then starts from random weights and is trained with the task (the command says so).

Tasks, data files, labels and metrics: glue_tasks.py.

Under torchrun or srun the fine-tuning is plain DDP: a DistributedSampler gives each rank its
share of every step's batch, and each rank predicts a strided slice of the dev set, gathered so
that the metrics cover every example exactly once; rank 0 prints and writes. Without a launcher
one process does everything.
"""

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from zoa_train.errors import UserError
from zoa_train.evaluation.glue_tasks import TASKS, Split, glue_average, glue_metrics, load_task_data, median_metrics, task_names, task_score

PROTOCOL = "glue dev, fine-tuned"


# ---- settings -------------------------------------------------------------------------------------


@dataclass
class FinetuneConfig:
    lr: float = 2e-5  # AdamW's peak learning rate
    epochs: int = 3
    batch_size: int = 32  # sequences per optimizer step over all ranks
    seq_len: int = 128  # tokens per example, [CLS] and [SEP]s included; longer inputs are truncated
    warmup_ratio: float = 0.1  # fraction of the steps with a linear warm-up, then linear decay to 0
    weight_decay: float = 0.01  # AdamW's decoupled decay, not on biases and LayerNorm weights
    grad_clip: float = 1.0  # max gradient norm (0: off)
    seed: int = 0  # the first seed; --seeds K uses seed .. seed+K-1


@dataclass
class _GlueSettings:
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


def finetune_config(overrides: list[str] = ()) -> FinetuneConfig:
    """FinetuneConfig from `--set finetune.KEY=VALUE` overrides, typed and checked as recipe keys are."""
    from zoa_train.config import apply_override, build_section  # the recipe schema's machinery (imports torch)

    data: dict = {}
    for override in overrides:
        apply_override(data, override)
    cfg = build_section(_GlueSettings, data, "--set").finetune
    for key in ("lr", "epochs", "batch_size", "seq_len"):
        if not getattr(cfg, key) > 0:
            raise UserError(f"--set: finetune.{key} must be positive, not {getattr(cfg, key)}.")
    if not 0 <= cfg.warmup_ratio < 1:
        raise UserError(f"--set: finetune.warmup_ratio must be in [0, 1), not {cfg.warmup_ratio}.")
    for key in ("weight_decay", "grad_clip", "seed"):
        if getattr(cfg, key) < 0:
            raise UserError(f"--set: finetune.{key} must be >= 0, not {getattr(cfg, key)}.")
    if cfg.seq_len < 4:
        raise UserError(f"--set: finetune.seq_len must be at least 4 ([CLS], [SEP] and a token of each sentence), not {cfg.seq_len}.")
    return cfg


def protocol_name(cfg: FinetuneConfig, seeds: int) -> str:
    runs = f"median of {seeds} seeds" if seeds > 1 else "1 seed"
    return (
        f"{PROTOCOL} {cfg.epochs} epochs with AdamW at lr {cfg.lr:g} (warm-up {cfg.warmup_ratio:g}, weight decay {cfg.weight_decay:g}), "
        f"batch {cfg.batch_size}, seq_len {cfg.seq_len}, {runs}"
    )


# ---- model ----------------------------------------------------------------------------------------


def encoder_weights(checkpoint: Path, loaded) -> dict:
    """The BERT encoder's state dict (keys without "bert."), with its pooler when the checkpoint has one."""
    if (Path(checkpoint) / "config.json").is_file():
        # A Hugging Face directory: its weights may hold a pooler that the masked-LM class drops.
        import transformers

        try:
            encoder = transformers.BertModel.from_pretrained(checkpoint)
        except (OSError, ValueError) as e:
            raise UserError(f"{checkpoint} is not a loadable BERT directory: {str(e).strip().splitlines()[0]}") from None
        state = encoder.state_dict()
        if not _has_saved_pooler(Path(checkpoint)):
            state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
        return state
    return loaded.model.bert.state_dict()


def _has_saved_pooler(directory: Path) -> bool:
    """Whether a Hugging Face directory's weight files name pooler weights."""
    index = [*directory.glob("*.index.json")]
    if index:
        return any("pooler." in key for f in index for key in json.loads(f.read_text()).get("weight_map", {}))
    for file in directory.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            if any("pooler." in key for key in f.keys()):
                return True
    for file in directory.glob("pytorch_model*.bin"):
        import torch

        if any("pooler." in key for key in torch.load(file, map_location="cpu", weights_only=True)):
            return True
    return False


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def classification_model(config, encoder_state: dict, num_labels: int):
    """A BertForSequenceClassification with the checkpoint's encoder; the head (and a missing pooler) freshly initialised."""
    import copy

    import transformers

    config = copy.deepcopy(config)
    config.num_labels = num_labels
    config.problem_type = "regression" if num_labels == 1 else "single_label_classification"
    config.architectures = ["BertForSequenceClassification"]
    model = transformers.BertForSequenceClassification(config)
    missing, unexpected = model.bert.load_state_dict(encoder_state, strict=False)
    missing = [k for k in missing if not k.startswith("pooler.") and not k.endswith("position_ids")]
    unexpected = [k for k in unexpected if not k.endswith("position_ids")]
    if missing or unexpected:
        raise UserError(f"the checkpoint's BERT encoder does not fit BertForSequenceClassification ({', '.join((missing + unexpected)[:3])} ...).")
    return model


# ---- fine-tuning ----------------------------------------------------------------------------------


class _Encoded:
    """Token ids of a split, padded per batch by `collate`."""

    def __init__(self, tokenizer, split: Split, seq_len: int, regression: bool):
        encoded = tokenizer(split.text_a, split.text_b, truncation=True, max_length=seq_len, return_token_type_ids=True)
        self.input_ids, self.token_type_ids = encoded["input_ids"], encoded["token_type_ids"]
        self.labels, self.regression, self.pad_id = split.labels, regression, tokenizer.pad_token_id or 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> int:
        return index

    def collate(self, indices: list[int]) -> dict:
        import torch

        width = max(len(self.input_ids[i]) for i in indices)
        ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(indices), width), dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices):
            n = len(self.input_ids[i])
            ids[row, :n] = torch.tensor(self.input_ids[i])
            types[row, :n] = torch.tensor(self.token_type_ids[i])
            mask[row, :n] = 1
        labels = torch.tensor([self.labels[i] for i in indices], dtype=torch.float32 if self.regression else torch.long)
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels}


def _optimizer(model, cfg: FinetuneConfig):
    import torch

    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr)


def finetune(model, train: "_Encoded", cfg: FinetuneConfig, seed: int, device, rank: int, world: int, advance=lambda n: None, start=lambda total: None):
    """Fine-tune `model` in place (DDP when world > 1); `start(total_steps)` and `advance(1)` report progress."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    per_rank = cfg.batch_size // world
    if world > 1:
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    else:
        sampler = RandomSampler(train, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(train, batch_size=per_rank, sampler=sampler, collate_fn=train.collate)
    total = cfg.epochs * len(loader)
    optimizer = _optimizer(model, cfg)
    warmup = math.ceil(cfg.warmup_ratio * total)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: step / max(1, warmup) if step < warmup else max(0.0, (total - step) / max(1, total - warmup))
    )
    wrapped = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    start(total)
    model.train()
    for epoch in range(cfg.epochs):
        if world > 1:
            sampler.set_epoch(epoch)
        for batch in loader:
            loss = wrapped(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            advance(1)
    model.eval()
    return total


def predict(model, data: "_Encoded", batch_size: int, device, rank: int, world: int):
    """Class ids (or STS-B scores) for every example of `data`: each rank predicts a strided slice and
    the slices are gathered, so every rank returns the predictions of the whole split in order."""
    import numpy as np
    import torch
    import torch.distributed as dist

    mine = list(range(rank, len(data), world))
    outputs = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            batch = data.collate(mine[start : start + batch_size])
            batch.pop("labels")
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
            outputs.append(logits[:, 0] if data.regression else logits.argmax(dim=-1))
    values = torch.cat(outputs).tolist() if outputs else []
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (mine, values))
    else:
        gathered = [(mine, values)]
    result = np.zeros(len(data), dtype=np.float64 if data.regression else np.int64)
    for indices, part in gathered:
        result[indices] = part
    return result


# ---- the evaluation -------------------------------------------------------------------------------


def evaluate_glue(checkpoint: str | Path, task: str, data_dir: str | Path, overrides: list[str] = (), seeds: int = 1, say=None) -> dict | None:
    """Fine-tune and score the checkpoint on one task or all; the results on rank 0, None on the other ranks."""
    names = task_names(task)
    cfg = finetune_config(overrides)
    if seeds < 1:
        raise UserError(f"--seeds must be at least 1, not {seeds}.")
    data = {name: load_task_data(data_dir, name) for name in names}  # every file is checked before any training

    import torch

    from zoa_train.distributed import evaluation_ranks
    from zoa_train.evaluation.checkpoints import load_language_model

    with _quiet_transformers():  # its loading reports (weights newly initialised, progress bars) are expected here
        loaded = load_language_model(checkpoint, "glue")
        encoder_state = encoder_weights(Path(checkpoint), loaded)
    config = loaded.model.config
    if cfg.seq_len > config.max_position_embeddings:
        raise UserError(f"--set: finetune.seq_len {cfg.seq_len} exceeds the model's {config.max_position_embeddings} positions.")
    fresh_pooler = not any(k.startswith("pooler.") for k in encoder_state)

    with evaluation_ranks() as ranks:
        device, rank, world = ranks.device, ranks.rank, ranks.world
        if cfg.batch_size % world:
            raise UserError(f"--set: finetune.batch_size {cfg.batch_size} is not divisible by the {world} ranks.")
        say = say if rank == 0 and say is not None else (lambda message: None)
        if fresh_pooler:
            say("note: the checkpoint has no pooler (a masked-LM model): the pooler starts from random weights and is fine-tuned with each task.")
        results = {}
        with _progress(rank == 0) as progress:
            for name in names:
                spec, splits = TASKS[name], data[name]
                train = _Encoded(loaded.tokenizer, splits.train, cfg.seq_len, spec.num_labels == 1)
                devs = {suffix: _Encoded(loaded.tokenizer, split, cfg.seq_len, spec.num_labels == 1) for suffix, split in splits.dev.items()}
                runs = []
                for seed in range(cfg.seed, cfg.seed + seeds):
                    label = f"{spec.title} seed {seed}"
                    bar = progress.add_task(f"{label}: fine-tuning", total=None)
                    torch.manual_seed(seed)
                    model = classification_model(config, encoder_state, spec.num_labels).to(device)
                    finetune(
                        model,
                        train,
                        cfg,
                        seed,
                        device,
                        rank,
                        world,
                        advance=lambda n, bar=bar: progress.advance(bar, n),
                        start=lambda total, bar=bar: progress.update(bar, total=total),
                    )
                    progress.update(bar, description=f"{label}: evaluating")
                    metrics = {"seed": seed}
                    for suffix, dev in devs.items():
                        metrics |= glue_metrics(name, predict(model, dev, 2 * max(1, cfg.batch_size // world), device, rank, world), dev.labels, suffix)
                    progress.update(bar, description=f"{label}: {_metric_text(metrics)}")
                    runs.append(metrics)
                    del model
                median = median_metrics([{k: v for k, v in r.items() if k != "seed"} for r in runs])
                results[name] = {
                    "metrics": median,
                    "score": task_score(name, median),
                    "per_seed": runs,
                    "train_examples": len(splits.train),
                    "dev_examples": {f"dev{suffix}": len(split) for suffix, split in splits.dev.items()},
                    "files": [splits.train.source, *(s.source for s in splits.dev.values())],
                    "skipped_rows": splits.train.skipped + sum(s.skipped for s in splits.dev.values()),
                }
    if rank != 0:
        return None
    result = {
        "protocol": protocol_name(cfg, seeds),
        "checkpoint": {"path": str(checkpoint), "source": loaded.source, "step": loaded.step, "averaged_ranks": loaded.averaged_ranks},
        "finetune": dataclasses.asdict(cfg),
        "seeds": list(range(cfg.seed, cfg.seed + seeds)),
        "data": str(data_dir),
        "world_size": world,
        "pooler": "fresh" if fresh_pooler else "checkpoint",
        "tasks": results,
    }
    if len(names) == len(TASKS):
        scores = {name: r["score"] for name, r in results.items()}
        result["glue_average"] = glue_average(scores)
        result["glue_average_without_wnli"] = glue_average(scores, without=("wnli",))
    return result


def _metric_text(metrics: dict) -> str:
    return ", ".join(f"{k} {_percent(v)}" for k, v in metrics.items() if k != "seed")


def _percent(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.1f}"


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass

    def advance(self, *args, **kwargs):
        pass


def _progress(show: bool):
    if not show:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from zoa_train import console as zoa_console

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=zoa_console.err)


def format_glue(result: dict):
    """A rich table: each task's (median) metrics and score in percent, and the GLUE average for all tasks."""
    from rich.table import Table

    table = Table()
    for column in ("task", "metrics", "score", "train", "dev"):
        table.add_column(column, justify="left" if column in ("task", "metrics") else "right")
    many = len(result["seeds"]) > 1
    if many:
        table.add_column("score per seed", justify="right")
    for name, r in result["tasks"].items():
        dev = " / ".join(f"{n:,}" for n in r["dev_examples"].values())
        row = [TASKS[name].title, _metric_text(r["metrics"]), _percent(r["score"]), f"{r['train_examples']:,}", dev]
        if many:
            row.append(", ".join(_percent(task_score(name, run)) for run in r["per_seed"]))
        table.add_row(*row)
    if "glue_average" in result:
        table.add_section()
        table.add_row("GLUE average", "9 tasks", _percent(result["glue_average"]), "", "", *([""] if many else []))
        table.add_row("without WNLI", "8 tasks", _percent(result["glue_average_without_wnli"]), "", "", *([""] if many else []))
    return table


def glue_command(
    checkpoint: Annotated[
        Path,
        typer.Option(
            help="A BERT run directory (its latest complete checkpoint), checkpoint directory, model file or Hugging Face directory.", show_default=False
        ),
    ],
    task: Annotated[str, typer.Option(help="cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli, or all (with the GLUE average).", show_default=False)],
    data_dir: Annotated[
        str,
        typer.Option(
            "--data-dir",
            help="The GLUE distribution (CoLA/train.tsv, CoLA/dev.tsv, ...), or hub for the hub's nyu-mll/glue when online. [default: glue_data]",
            show_default=False,
        ),
    ] = "glue_data",
    set_: Annotated[
        list[str],
        typer.Option(
            "--set", help="Fine-tuning setting: finetune.lr, .epochs, .batch_size, .seq_len, .warmup_ratio, .weight_decay, .grad_clip, .seed (repeatable)."
        ),
    ] = [],
    seeds: Annotated[int, typer.Option(help="Fine-tune with seeds seed .. seed+K-1 and report the medians. [default: 1]", show_default=False)] = 1,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """Fine-tune a BERT checkpoint on GLUE tasks and score it on their dev splits (run_glue's metrics; under torchrun or srun, DDP over the ranks)."""
    from zoa_train import console as zoa_console
    from zoa_train.files import check_output_file, write_json_file

    if json_out is not None:
        check_output_file(json_out, "--json")  # before the fine-tuning: its result must have somewhere to go
    result = evaluate_glue(checkpoint, task, data_dir, set_, seeds, say=zoa_console.err.print)
    if result is None:  # not rank 0
        return
    if json_out is not None:
        write_json_file(json_out, result, "--json")
    console = zoa_console.out
    step = result["checkpoint"]["step"]
    console.print(f"{result['checkpoint']['source']}" + (f" (step {step})" if step is not None else ""), highlight=False, soft_wrap=True)
    console.print(result["protocol"], highlight=False, soft_wrap=True)
    console.print(format_glue(result))
