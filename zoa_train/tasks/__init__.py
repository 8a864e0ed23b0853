"""Tasks: what a recipe trains, behind one interface the trainer uses without knowing which.

  causal_lm             a decoder on a token stream (model.kind gpt2, llama)
  masked_lm             BERT, masked LM with the optional next-sentence head (model.kind bert)
  image_classification  torchvision ResNets on ImageFolder trees (model.kind resnet18/34/50)

`model.kind` names the model family (zoa_train/models/registry.py) and its entry the task: one key,
and the recipes written before tasks existed keep working. A task builds its data (training loader,
validation batches) and its model (through the family's builder), computes the loss and the
validation metrics of a batch, names its throughput unit, and writes what it needs beside a
checkpoint (a tokenizer, the class names). See tasks/base.py.
"""

from pathlib import Path

from zoa_train.files import make_directory
from zoa_train.models import registry as models
from zoa_train.tasks.base import Task

TASKS = {
    "causal_lm": ("zoa_train.tasks.language", "CausalLM"),
    "masked_lm": ("zoa_train.tasks.language", "MaskedLM"),
    "image_classification": ("zoa_train.tasks.images", "ImageClassification"),
}


def task_of(kind: str) -> type[Task]:
    """The Task subclass that the model family `kind` trains (its module imports nothing heavy)."""
    import importlib

    module, name = TASKS[models.get(kind).task]
    return getattr(importlib.import_module(module), name)


def task_class(recipe) -> type[Task]:
    """The Task subclass that the recipe's model family trains."""
    return task_of(recipe.model.kind)


def build_task(recipe, rank: int = 0, world_size: int = 1) -> Task:
    """The recipe's task with its data prepared for this rank (the model is built by build_model)."""
    make_directory(Path(recipe.data.cache_dir).expanduser(), "data.cache_dir")  # every task's data is cached there
    return task_class(recipe)(recipe, rank, world_size)


__all__ = ["TASKS", "Task", "build_task", "task_class", "task_of"]
