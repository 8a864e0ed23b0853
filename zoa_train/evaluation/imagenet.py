"""`zoa-train eval imagenet`: top-1, top-5 and loss of a ResNet checkpoint over an ImageFolder validation set.

Every image is counted exactly once: each rank takes a contiguous slice of the sorted images (under
torchrun or srun the work is split over the ranks, otherwise one process does it all) and the
sums are added with one allreduce. The model's class order is the run's classes.json when the
checkpoint comes from a run directory, so a validation folder only needs the same class names
(it may hold a subset of the classes); a bare model file takes the folder's sorted class names.
The evaluation transform is the run's recipe's (resize, centre crop), or --resize-size/--crop-size.
"""

import json
from pathlib import Path

import torch

from zoa_train.errors import UserError

TASK_WORDS = {"causal_lm": "a causal LM", "masked_lm": "a masked LM"}


def evaluate_imagenet(
    checkpoint: str | Path,
    data: str | Path,
    batch_size: int = 64,
    workers: int = 4,
    model_kind: str | None = None,
    resize_size: int | None = None,
    crop_size: int | None = None,
) -> dict | None:
    """The metrics as a dict on rank 0 (None on the other ranks)."""
    from zoa_train.config import model_section
    from zoa_train.data.images import eval_transform, image_validation_batches, scan_image_folder
    from zoa_train.distributed import evaluation_ranks
    from zoa_train.evaluation.checkpoints import read_model_state, run_recipe
    from zoa_train.models import ModelInputs, create
    from zoa_train.models import registry as models
    from zoa_train.tasks.base import evaluate_batches
    from zoa_train.tasks.images import ImageClassification, classification_sums
    from zoa_train.train.rundir import resolve_model_file

    model_file, run = resolve_model_file(checkpoint)
    recipe = run_recipe(run.path) if run is not None else None
    kind = model_kind or (recipe.model.kind if recipe is not None else "resnet18")
    spec = models.get(kind)
    if "imagenet" not in spec.evaluations:  # a run of another task: its model.pt holds no classifier to read
        others = " or ".join(f"zoa-train eval {name}" for name in spec.evaluations)
        fix = f"evaluate it with {others}" if others else "no zoa-train evaluation takes it"
        classifiers = ", ".join(s.title for s in models.accepting("imagenet"))
        raise UserError(
            f"{run.path if run is not None else model_file} trains a {spec.title} model ({TASK_WORDS.get(spec.task, spec.task)}) and eval imagenet "
            f"evaluates image classifiers ({classifiers}); {fix}."
        )
    if recipe is not None and model_kind and model_kind != recipe.model.kind:
        raise UserError(f"--model {model_kind} disagrees with the run's recipe, which trained {recipe.model.kind}.")
    samples, folder_classes = scan_image_folder(data)
    classes = folder_classes
    classes_file = run.path / "classes.json" if run is not None else None
    if classes_file is not None and classes_file.is_file():
        classes = json.loads(classes_file.read_text())
        index = {name: i for i, name in enumerate(classes)}
        unknown = [name for name in folder_classes if name not in index]
        if unknown:
            raise UserError(f"{data} has class folders the model was not trained on ({', '.join(unknown[:5])}); they must match {classes_file}.")
        samples = [(path, index[folder_classes[label]]) for path, label in samples]
    try:
        state = (
            read_model_state(model_file)[0] if model_file.is_dir() else torch.load(model_file, map_location="cpu", weights_only=True)
        )  # a sharded run's model/
        model = create(model_section()(kind=kind), ModelInputs(num_classes=state["fc.weight"].shape[0]))
        model.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 -- whatever torch.load or the state dict raise, the file is not this model
        # torch's own text may run to several sentences and lines: its first clause says enough
        first = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise UserError(f"{model_file} is not a {kind} model file ({first}).") from None
    if model.fc.out_features < len(classes):
        raise UserError(f"{model_file} has {model.fc.out_features} outputs but {data} has {len(classes)} classes.")

    with evaluation_ranks() as ranks:
        d = recipe.data if recipe is not None else None
        transform = eval_transform(resize_size or (d.resize_size if d else 256), crop_size or (d.crop_size if d else 224))
        model.to(ranks.device)
        batches = image_validation_batches(samples, transform, batch_size, ranks.rank, ranks.world, None, workers, ranks.device.type == "cuda")
        metrics, count = evaluate_batches(
            model, batches, classification_sums, ImageClassification.metrics, lambda b, dev: {k: v.to(dev) for k, v in b.items()}, ranks.device
        )
    if ranks.rank != 0:
        return None
    return {
        "checkpoint": str(model_file),
        "data": str(data),
        "model": kind,
        "images": count,
        "classes": len(folder_classes),
        "top1": metrics["val_top1"],
        "top5": metrics["val_top5"],
        "loss": metrics["val_loss"],
    }
