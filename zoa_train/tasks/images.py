"""image_classification: torchvision ResNets on ImageFolder trees (ImageNet as usually unpacked, or
the bundled digits), trained with cross-entropy; validation reports loss, top-1 and top-5.

Data (zoa_train/data/images.py): RandomResizedCrop + optional flip + normalisation for training,
resize + centre crop for evaluation, decoded by DataLoader workers behind a sampler whose position
is part of the checkpoint. On CUDA the model and its inputs are channels-last (faster convolutions
on tensor cores) and batches come from pinned memory.
"""

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from zoa_train.errors import UserError
from zoa_train.models import ModelInputs, create
from zoa_train.tasks.base import IMAGE_SOURCES, Task

IMAGENET_CLASSES = 1000  # what `plan` counts for a folder it has not scanned
DIGITS_CLASSES = 10


class ImageClassification(Task):
    name = "image_classification"
    unit = "images"
    units_per_sample = 1
    metrics = ("val_loss", "val_top1", "val_top5")

    def __init__(self, recipe, rank: int, world_size: int):
        from zoa_train.data.images import DistributedImageLoader, ImageFolderData, prepare_digits, train_transform

        super().__init__(recipe, rank, world_size)
        d, t = recipe.data, recipe.train
        root = prepare_digits(Path(d.cache_dir).expanduser()) if d.source == "digits" else Path(d.root).expanduser()
        self.data = ImageFolderData.scan(root)
        self.classes = self.data.classes
        self.channels_last = torch.cuda.is_available() and t.backend != "gloo"
        self.loader = DistributedImageLoader(
            self.data.train,
            train_transform(d.crop_size, d.min_crop_scale, d.hflip),
            t.micro_batch_size,
            rank,
            world_size,
            t.seed,
            num_workers=d.workers,
            pin_memory=self.channels_last,
            global_batch_size=t.global_batch_size,
        )

    @classmethod
    def check(cls, recipe, origin: str) -> None:
        d = recipe.data
        if d.source not in IMAGE_SOURCES:
            raise UserError(f"{origin}: data.source must be digits or folder for {recipe.model.kind}, not {d.source!r}.")
        if d.source == "folder" and not d.root:  # whether it exists is checked when the data is read: `plan` needs none
            raise UserError(f"{origin}: data.root must name the image folder (holding train/ and val/) when data.source is folder.")

    @classmethod
    def model_for_counting(cls, recipe) -> torch.nn.Module:
        classes = DIGITS_CLASSES if recipe.data.source == "digits" else IMAGENET_CLASSES
        return create(dataclasses.replace(recipe.model, init_from=None), ModelInputs(num_classes=classes))

    def build_model(self) -> torch.nn.Module:
        model = create(self.recipe.model, ModelInputs(num_classes=len(self.classes)))
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def to_device(self, batch: dict, device: torch.device) -> dict:
        pixels = batch["pixel_values"].to(device, non_blocking=True)
        if self.channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return {"pixel_values": pixels, "labels": batch["labels"].to(device, non_blocking=True)}

    @classmethod
    def loss(cls, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])

    @classmethod
    def example_batch(cls, recipe, size: int) -> dict:
        crop = recipe.data.crop_size
        return {"pixel_values": torch.zeros(size, 3, crop, crop), "labels": torch.zeros(size, dtype=torch.long)}

    def validation_batches(self, max_batches: int | None):
        from zoa_train.data.images import eval_transform, image_validation_batches

        d = self.recipe.data
        transform = eval_transform(d.resize_size, d.crop_size)
        return image_validation_batches(
            self.data.val, transform, self.recipe.train.micro_batch_size, self.rank, self.world_size, max_batches, d.workers, self.channels_last
        )

    def metric_sums(self, model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        return classification_sums(model, batch)

    def save_artifacts(self, run_dir: Path) -> None:
        (run_dir / "classes.json").write_text(json.dumps(self.classes) + "\n")

    def close(self) -> None:
        self.loader.close()


def classification_sums(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """Summed cross-entropy, top-1 and top-5 hits (top-k with k capped at the number of classes), and the count."""
    logits, labels = model(batch["pixel_values"]).float(), batch["labels"]
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    hits = top == labels.unsqueeze(1)
    return {
        "val_loss": F.cross_entropy(logits, labels, reduction="sum"),
        "val_top1": hits[:, 0].sum(),
        "val_top5": hits.any(dim=1).sum(),
        "count": torch.tensor(float(len(labels)), device=logits.device),
    }
