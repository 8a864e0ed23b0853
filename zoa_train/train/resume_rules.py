"""What a resume may change: every recipe key either applies from the first step after the checkpoint,
said in one line ("resuming with optimizer.lr 0.0003, was 0.001"), or is refused in one sentence that
says why and what to do. Nothing is ignored: a resumed run trains with what its recipe.yaml says.

A checkpoint records the recipe it was trained with (trainer.pt "recipe") and the changes made on
earlier resumes ("recipe_changes"); the run directory's recipe_changes.yaml lists them, each with the
first step it took effect at, so recipe.yaml and that file together describe the whole run.

Rules, by key: None (it applies), a string (why it cannot change during a run; the refusal's reason),
or a function of the ResumeChange returning either. The optimizer knobs' rules are in their registry
entries (OptimizerSpec.resume; a knob without one is refused), the shared ones in registry.SHARED_RESUME;
the model section describes the model the checkpoint holds, so only its dropout may change.
Keys of the 1-bit layout (comm.topology, ranks_per_node, bucket_cap_mb, overlap, shard) apply when
the layout they give is the saved one, or with --reshard; the checkpoint's loading decides (the
trainer names the changed keys when it refuses).
"""

from dataclasses import dataclass
from pathlib import Path

from zoa_train.config import Recipe
from zoa_train.errors import UserError
from zoa_train.optim import registry

CHANGES = "recipe_changes.yaml"  # in the run directory: every change made on a resume, with its step

# The keys that lay the 1-bit rounds out: a change applies where the layout stays the saved one, or with --reshard.
LAYOUT = ("comm.topology", "comm.ranks_per_node", "comm.bucket_cap_mb", "comm.overlap", "comm.shard", "train.nproc")


@dataclass(frozen=True)
class ResumeChange:
    """One recipe key whose value differs from the checkpoint's: what the rules judge."""

    key: str
    was: object
    now: object
    recipe: Recipe  # this run's
    step: int  # steps the checkpoint has taken: the change takes effect at step + 1

    def record(self) -> dict:
        return {"step": self.step + 1, "key": self.key, "was": self.was, "now": self.now}


Rule = registry.ResumeRule  # None, a reason, or a function of the ResumeChange giving either

_SAME_DATA = "the checkpoint's model and its position in the data are those of the data it was trained on"
_HELD_OUT = "without validation files the validation set is held out of the training files, so adding or dropping them changes the training data"
_HELD_OUT_PREFIXES = "without validation prefixes the validation set is held out of the training prefixes, so adding or dropping them changes the training data"
_SEED = "it drew the initial model and seeds the data order and every rank's random streams, which continue from the checkpoint"

RULES: dict[str, Rule] = {
    **dict.fromkeys(
        ["data.source", "data.config", "data.train_files", "data.text_field", "data.tokenizer", "data.vocab_size", "data.seq_len", "data.root"]
        + ["data.streaming", "data.shuffle_window"],  # a streamed position is one of the stream, read in windows of that size
        _SAME_DATA,
    ),
    "data.validation_files": lambda c: None if c.was and c.now else _HELD_OUT,
    **dict.fromkeys(["data.cache_dir", "data.workers", "data.crop_size", "data.resize_size", "data.min_crop_scale", "data.hflip"]),
    **dict.fromkeys(["data.prefixes", "data.weights"], _SAME_DATA),
    "data.validation_prefixes": lambda c: None if c.was and c.now else _HELD_OUT_PREFIXES,
    "data.tokenize_workers": None,
    **dict.fromkeys(["schedule.name", "schedule.warmup_steps", "schedule.decay_factor", "schedule.decay_every", "schedule.min_lr"]),
    # train.micro_batch_size: the data continue at the same sample (the position is converted)
    **dict.fromkeys(
        [
            "train.steps",
            "train.global_batch_size",
            "train.micro_batch_size",
            "train.precision",
            "train.grad_clip",
            "train.grad_clip_rule",
            "train.skip_nonfinite",
        ]
    ),
    **dict.fromkeys(["train.nproc", "train.backend", "train.timeout_s", "train.log_every", "train.val_every", "train.val_batches", "train.checkpoint_every"]),
    **dict.fromkeys(["train.keep_checkpoints", "train.activation_checkpointing", "train.compile", "train.peak_tflops", "train.elastic"]),
    "train.seed": _SEED,
    **dict.fromkeys(["comm.topology", "comm.ranks_per_node", "comm.bucket_cap_mb", "comm.overlap", "comm.shard", "comm.kernels"]),
    **dict.fromkeys(["logging.wandb", "logging.tensorboard", "logging.project", "imports"]),
    "optimizer.name": "the checkpoint holds that optimizer's state; to compare optimizers, train each from step 0 (or start a new run from this one's model)",
    "model.dropout": None,
}

_MODEL = (
    "the model section describes the model the checkpoint holds; to train another model from this one's weights, "
    "export it (zoa-train export) and start a new run with model.init_from"
)


def rule(key: str, recipe: Recipe) -> Rule:
    """The rule for `key`: the table's, the optimizer registry's for an optimizer knob, the model's."""
    section, _, name = key.partition(".")
    if key in RULES:
        return RULES[key]
    if section == "model":
        return _MODEL
    if section == "optimizer":
        return registry.resume_rule(name, recipe.optimizer.name)
    return f"zoa-train does not know whether {key} can change during a run"


def flat(values: dict, prefix: str = "") -> dict:
    """A recipe mapping as dotted key -> value (lists and tuples alike, as lists)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def changes(saved: dict, recipe: Recipe, step: int) -> list[ResumeChange]:
    """The keys whose value differs from the checkpoint's recipe; a key the checkpoint's zoa-train did not
    have yet counts as its default (what that run trained with)."""
    was = flat(Recipe().to_dict()) | flat(saved)
    return [ResumeChange(key, was[key], now, recipe, step) for key, now in flat(recipe.to_dict()).items() if key in was and was[key] != now]


def judge(checkpoint: Path, found: list[ResumeChange]) -> None:
    """Refuse, in one sentence, the first change that cannot take effect on a resume."""
    for change in found:
        reason = rule(change.key, change.recipe)
        if callable(reason):
            reason = reason(change)
        if reason is not None:
            raise UserError(
                f"cannot resume from {checkpoint} with {change.key} {show(change.now)}: the checkpoint was trained with {show(change.was)}, and {reason}; "
                f"resume with {change.key} {show(change.was)}."
            )


def applied(found: list[ResumeChange]) -> list[str]:
    """One line for each change that takes effect (said of an optimizer knob this run does not read)."""
    lines = []
    for c in found:
        section, _, name = c.key.partition(".")
        unused = section == "optimizer" and not registry.uses_knob(c.recipe.optimizer.name, name)
        lines.append(
            f"resuming with {c.key} {show(c.now)}, was {show(c.was)} (from step {c.step + 1}{'; optimizer ' + c.recipe.optimizer.name + ' does not use it' if unused else ''})"
        )
    return lines


def show(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def saved_recipe(trainer_state: dict, checkpoint: Path) -> dict | None:
    """The recipe a checkpoint was trained with: its own record, or for a checkpoint written before it had
    one, the recipe.yaml of the run directory it lies in; None where neither exists."""
    if "recipe" in trainer_state:
        return trainer_state["recipe"]
    from zoa_train.files import load_yaml

    for directory in checkpoint.parents[:3]:
        if (directory / "recipe.yaml").is_file():
            return load_yaml((directory / "recipe.yaml").read_text(encoding="utf-8"), str(directory / "recipe.yaml")) or None
    return None


def recorded(found: list[ResumeChange]) -> list[dict]:
    return [c.record() for c in found]
