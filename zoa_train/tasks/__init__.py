"""Tasks: what a recipe trains, behind one interface the trainer uses without knowing which.

  causal_lm             GPT-2 on a token stream (model.kind gpt2)
  masked_lm             BERT, masked LM with the optional next-sentence head (model.kind bert)
  image_classification  torchvision ResNets on ImageFolder trees (model.kind resnet18/34/50)

`model.kind` names the model family and with it the task: one key, and the recipes written before
tasks existed keep working. A task builds its data (training loader, validation batches) and its
model, computes the loss and the validation metrics of a batch, names its throughput unit, and
writes what it needs beside a checkpoint (a tokenizer, the class names). See tasks/base.py.
"""

from pathlib import Path

from zoa_train.files import make_directory
from zoa_train.tasks.base import Task

_TASKS = {
    "gpt2": ("zoa_train.tasks.language", "CausalLM"),
    "bert": ("zoa_train.tasks.language", "MaskedLM"),
    "resnet18": ("zoa_train.tasks.images", "ImageClassification"),
    "resnet34": ("zoa_train.tasks.images", "ImageClassification"),
    "resnet50": ("zoa_train.tasks.images", "ImageClassification"),
}


def task_class(recipe) -> type[Task]:
    """The Task subclass for the recipe's model.kind (its module imports nothing heavy)."""
    import importlib

    module, name = _TASKS[recipe.model.kind]
    return getattr(importlib.import_module(module), name)


def build_task(recipe, rank: int = 0, world_size: int = 1) -> Task:
    """The recipe's task with its data prepared for this rank (the model is built by build_model)."""
    make_directory(Path(recipe.data.cache_dir).expanduser(), "data.cache_dir")  # every task's data is cached there
    return task_class(recipe)(recipe, rank, world_size)


__all__ = ["Task", "build_task", "task_class"]
