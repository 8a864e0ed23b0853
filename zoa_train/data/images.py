"""Image-classification data: ImageFolder trees, ImageNet-style transforms and the distributed image loader.

Layout: ``<root>/{train,val}/<class name>/<image>``, as torchvision's ImageFolder expects; class
indices are the class folder names in sorted order. ``prepare_digits`` builds such a tree from
scikit-learn's bundled 8x8 handwritten digits (no download), upscaled to 32x32 RGB.

``DistributedImageLoader`` has the semantics of the text ``DistributedBatchLoader``: one global
order of samples, each global batch split among the ranks, and the position is all the state
(``SampleOrder``). Images
are decoded and augmented in DataLoader worker processes. Each item's random draws (crop, flip)
come from a seed derived from (seed, epoch, sample index) alone, so an item is augmented the same
way whichever worker decodes it, however many workers there are, at any world size, and after a
resume: a resumed run gets bit-identical batches.

A corrupt or unreadable image file stops the run with an ``UnreadableImage`` error naming the file,
rather than being skipped: skipping would change the batches (and so break exact resume and
comparisons between runs), and a broken file is better fixed once than silently dropped.
"""

import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from torchvision.transforms import v2

from zoa_train.data.cache import exclusive_lock, temporary_name
from zoa_train.data.lm import SampleOrder, check_same_data
from zoa_train.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DIGITS_SIZE = 32  # the 8x8 digits are upscaled to this, so that crops and a ResNet stem have room
DIGITS_VAL_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0  # fixed: the digits split must not depend on a run's seed
_AUGMENT_STREAM = 1  # keeps the per-item augmentation seeds apart from the epoch permutation

Sample = tuple[str, int]  # (image file path, class index)
Transform = Callable[[Image.Image], torch.Tensor]


class UnreadableImage(UserError):
    """An image file that cannot be opened or decoded; the message is one sentence naming the file.

    torch's DataLoader re-raises an exception from a worker process as ``UnreadableImage(wrapped)``
    where ``wrapped`` is "Caught UnreadableImage in DataLoader worker process N.\\nOriginal Traceback
    ...". The constructor recovers the original sentence, the traceback's last line, so the main
    process reports the same clean sentence as a run without workers.
    """

    def __init__(self, message: str):
        super().__init__(_worker_sentence(message))


def _worker_sentence(message: str) -> str:
    """The original message inside a DataLoader worker's wrapped traceback, or ``message`` itself if it is not one."""
    name = UnreadableImage.__name__
    if not message.startswith(f"Caught {name} ") or "\nOriginal Traceback" not in message:
        return message
    last_line = message.rstrip().rsplit("\n", 1)[-1]
    _, found, sentence = last_line.partition(f"{name}: ")
    return sentence if found else message


# --- the bundled digits -------------------------------------------------------------------------


def prepare_digits(cache_dir: str | Path) -> Path:
    """The root of a digits ImageFolder tree (``train/`` and ``val/``, classes "0".."9"), built on first use.

    The tree is ``<cache_dir>/images/digits32``: scikit-learn's 1,797 bundled 8x8 digits, upscaled
    to 32x32 RGB PNGs, split 80/20 per class with a fixed seed. Safe to call from all ranks at once:
    one builds under a lock into a temporary sibling that is renamed into place when complete, the
    others wait and reuse it.
    """
    root = Path(cache_dir) / "images" / f"digits{DIGITS_SIZE}"
    if not root.is_dir():
        with exclusive_lock(root.with_name(root.name + ".lock")):
            if not root.is_dir():
                _build_digits(root)
    return root


def _build_digits(root: Path) -> None:
    # imported here: scikit-learn takes a while to import and only this needs it
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)  # 0..16 intensities to 0..255
    labels = digits.target
    # Stratified, so each class keeps its share in both splits: 360 of 1,797 held out. An integer
    # random_state draws from numpy's legacy RandomState, whose stream numpy keeps fixed across versions.
    _, val_indices = train_test_split(np.arange(len(labels)), test_size=DIGITS_VAL_FRACTION, stratify=labels, random_state=_DIGITS_SPLIT_SEED)
    val = np.zeros(len(labels), dtype=bool)
    val[val_indices] = True
    tmp = temporary_name(root)
    shutil.rmtree(tmp, ignore_errors=True)
    for index, (image, label, held_out) in enumerate(zip(pixels, labels, val)):
        folder = tmp / ("val" if held_out else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        big = Image.fromarray(image, mode="L").resize((DIGITS_SIZE, DIGITS_SIZE), Image.Resampling.BICUBIC)
        big.convert("RGB").save(folder / f"{index:04d}.png")
    (tmp / "SOURCE.txt").write_text(
        "scikit-learn's load_digits(): the UCI ML hand-written digits (Optical Recognition of Handwritten Digits), CC BY 4.0;\n"
        f"8x8 images upscaled to {DIGITS_SIZE}x{DIGITS_SIZE} (bicubic), {DIGITS_VAL_FRACTION:.0%} held out in val/ by a stratified "
        f"train_test_split(random_state={_DIGITS_SPLIT_SEED}); file names are the index in load_digits().\n"
    )
    try:
        os.rename(tmp, root)
    except OSError:
        if not root.is_dir():  # another builder that ignored the lock won the rename: its tree is as good as ours
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# --- ImageFolder trees --------------------------------------------------------------------------


def scan_image_folder(path: str | Path) -> tuple[list[Sample], list[str]]:
    """The images under ``path/<class name>/`` as (file path, class index) pairs, and the sorted class names.

    Files count as images by their extension (torchvision's IMG_EXTENSIONS, any case, e.g. ImageNet's
    .JPEG); subfolders of a class folder are searched too. A missing folder, one without class
    folders or images, or an empty class folder is a UserError naming the path.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"Image folder {path} does not exist.")
    if not path.is_dir():
        raise UserError(f"Image folder {path} is not a directory.")
    try:
        classes, class_to_index = find_classes(path)
    except FileNotFoundError:
        raise UserError(f"Image folder {path} has no class subfolders; it should hold one folder of images per class (<class name>/<image>).") from None
    except OSError as e:
        raise UserError(f"Could not read image folder {path} ({e.strerror or e}).") from None
    try:
        samples = make_dataset(path, class_to_index, extensions=IMG_EXTENSIONS, allow_empty=True)
    except OSError as e:
        raise UserError(f"Could not read image folder {path} ({e.strerror or e}).") from None
    extensions = ", ".join(IMG_EXTENSIONS)
    if not samples:
        raise UserError(f"Image folder {path} has no image files in its class subfolders (looked for {extensions}).")
    counts = np.bincount([label for _, label in samples], minlength=len(classes))
    empty = [str(path / classes[i]) for i in np.flatnonzero(counts == 0)]
    if empty:
        named = empty[0] if len(empty) == 1 else f"{', '.join(empty[:3])}{f' and {len(empty) - 3} more' if len(empty) > 3 else ''}"
        raise UserError(
            f"Class folder{'s' if len(empty) > 1 else ''} {named} {'has' if len(empty) == 1 else 'have'} no image files "
            f"(looked for {extensions}); add images or remove the folder."
        )
    return samples, classes


@dataclass(frozen=True)
class ImageFolderData:
    """The train and validation samples of an ImageFolder root, with the class names they index."""

    root: Path
    classes: list[str]
    train: list[Sample]
    val: list[Sample]

    @classmethod
    def scan(cls, root: str | Path) -> "ImageFolderData":
        """Scan ``root/train`` and ``root/val``, which must have the same class folders (so a class index means one class)."""
        root = Path(root)
        train, classes = scan_image_folder(root / "train")
        val, val_classes = scan_image_folder(root / "val")
        if val_classes != classes:
            only_train, only_val = sorted(set(classes) - set(val_classes)), sorted(set(val_classes) - set(classes))
            difference = "; ".join(
                f"only in {split}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                for split, names in (("train", only_train), ("val", only_val))
                if names
            )
            raise UserError(f"The class folders of {root / 'train'} and {root / 'val'} differ ({difference}); both need the same classes.")
        return cls(root, classes, train, val)


# --- transforms ---------------------------------------------------------------------------------


def _normalised_tensor() -> list[v2.Transform]:
    """PIL image to float32 CHW in [0, 1], normalised with the ImageNet mean and std."""
    return [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD), v2.ToPureTensor()]


def train_transform(crop_size: int = 224, min_scale: float = 0.08, hflip: bool = True) -> v2.Compose:
    """ImageNet training augmentation: a random-resized crop of ``min_scale``..1 of the area, a random flip, normalised."""
    if not 0 < min_scale <= 1:
        raise UserError(f"The crop's min_scale must be in (0, 1], not {min_scale}.")
    steps: list[v2.Transform] = [v2.RandomResizedCrop(crop_size, scale=(min_scale, 1.0), antialias=True)]
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps + _normalised_tensor())


def eval_transform(resize_size: int = 256, crop_size: int = 224) -> v2.Compose:
    """ImageNet evaluation: shorter side resized to ``resize_size``, a centre crop of ``crop_size``, normalised."""
    if resize_size < crop_size:
        raise UserError(f"The evaluation resize_size ({resize_size}) must be at least the crop_size ({crop_size}).")
    return v2.Compose([v2.Resize(resize_size, antialias=True), v2.CenterCrop(crop_size)] + _normalised_tensor())


# --- dataset and loaders ------------------------------------------------------------------------


@contextmanager
def _seeded_torch_rng(seed: int) -> Iterator[None]:
    """Run the body on torch's global CPU generator seeded with ``seed``, then restore the generator.

    Transforms draw from the global generator; restoring it keeps the caller's stream (e.g. dropout
    in the training process when there are no workers) untouched. Far cheaper than
    ``torch.random.fork_rng`` + ``torch.manual_seed``, which also visit every accelerator.
    """
    generator = torch.default_generator
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


def _load_rgb(path: str) -> Image.Image:
    """Decode ``path`` fully into an RGB image, or raise UnreadableImage naming it."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        reason = "not a recognised image format"
    except Exception as e:  # noqa: BLE001 - PIL's decoders fail on damaged files with OSError, SyntaxError, struct.error, ...
        reason = (getattr(e, "strerror", None) or str(e) or type(e).__name__).splitlines()[0].rstrip(".")
    raise UnreadableImage(f"Image file {path} is corrupt or unreadable ({reason}); replace or delete it, then resume the run.")


class ImageDataset(Dataset):
    """Samples decoded with PIL and transformed; item keys are (sample index, seed) pairs.

    The transform's random draws come from torch's global generator seeded with the key's seed, so
    a key always gives the same tensor, in whichever process it is decoded. The paths are kept in
    one byte buffer rather than a list of strings: worker processes then share it with the parent
    instead of copying it page by page as reference counts touch it (1.3M ImageNet paths).
    """

    def __init__(self, samples: Sequence[Sample], transform: Transform):
        encoded = [os.fsencode(path) for path, _ in samples]
        self._path_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._path_ends = np.cumsum([len(path) for path in encoded], dtype=np.int64)
        self.labels = np.array([label for _, label in samples], dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> str:
        start = int(self._path_ends[index - 1]) if index else 0
        return os.fsdecode(self._path_bytes[start : self._path_ends[index]].tobytes())

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key
        image = _load_rgb(self.path(index))
        with _seeded_torch_rng(seed):
            pixels = self.transform(image)
        return pixels, int(self.labels[index])


def collate_images(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Stack items into ``{"pixel_values": float32 (B, 3, H, W), "labels": int64 (B,)}``.

    ``default_collate`` stacks straight into shared memory inside a worker, saving a copy on the way to the main process.
    """
    pixel_values, labels = default_collate(items)
    return {"pixel_values": pixel_values, "labels": labels}


def _init_worker(worker_id: int) -> None:
    """One intra-op thread per worker: the workers are the parallelism (torch's worker loop does this too; kept explicit)."""
    torch.set_num_threads(1)


def _data_loader(
    dataset: ImageDataset,
    batch_sampler: Iterable[list[tuple[int, int]]],
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int,
    persistent: bool,
) -> DataLoader:
    """A DataLoader over ``dataset`` whose batches of keys come from ``batch_sampler``."""
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate_images,
        pin_memory=pin_memory and torch.cuda.is_available(),  # pinning only helps copies to a GPU (and warns without one)
        worker_init_fn=_init_worker if num_workers else None,
        persistent_workers=persistent and num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers else None,
        # A private generator: each new DataLoader iterator draws its workers' base seed from it, which would
        # otherwise advance the global generator and make the trainer's own draws depend on when iterators are made.
        generator=torch.Generator(),
    )


class _EpochBatchSampler:
    """Yields batches of (index, seed) keys: this rank's micro-batches from the position to the end of the epoch; set before each iterator."""

    def __init__(self) -> None:
        self.keys = np.empty((0, 0, 2), dtype=np.int64)  # (batches, micro_batch_size, [index, seed])

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.keys:
            yield [tuple(key) for key in batch.tolist()]


class DistributedImageLoader:
    """Endless image micro-batches for one rank of a data-parallel run, reshuffled and re-augmented every epoch.

    The same order as the text ``DistributedBatchLoader`` (``SampleOrder``: one global order, each
    global batch of ``global_batch_size`` split among the ranks; by default one micro-batch per rank).
    Sample ``i`` of epoch ``e`` is augmented from a seed drawn from (seed, e) for ``i``, so it looks
    the same at any world size and number of workers.

    Decoding runs in a DataLoader with ``num_workers`` persistent worker processes (0: in this
    process), each keeping ``prefetch_factor`` batches in flight. The state is the position of the
    batches returned so far, not of those prefetched, so ``state_dict`` / ``load_state_dict`` resume
    exactly (and at another world size, micro-batch or global batch size continue at the next unseen
    sample); the DataLoader iterator restarts at each epoch and after ``load_state_dict``.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        transform: Transform,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        global_batch_size: int | None = None,
    ):
        if num_workers < 0:
            raise ValueError(f"need num_workers >= 0, got {num_workers}")
        global_batch_size = global_batch_size or world_size * micro_batch_size
        if len(samples) < global_batch_size:
            raise UserError(
                f"The training data has {len(samples)} images, fewer than a global batch of {global_batch_size}; use more images or a smaller batch."
            )
        self.order = SampleOrder(len(samples), micro_batch_size, rank, world_size, seed, global_batch_size)
        self.dataset, self.seed = ImageDataset(samples, transform), seed
        self._seeds_epoch, self._item_seeds = -1, np.empty(0, dtype=np.int64)
        self._sampler = _EpochBatchSampler()
        self._loader = _data_loader(self.dataset, self._sampler, num_workers, pin_memory, prefetch_factor, persistent=True)
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None  # the DataLoader iterator, from the current position
        self._left = 0  # the batches that iterator has still to give, to the epoch's end

    def __len__(self) -> int:
        """Micro-batches per epoch of this rank (the iterator itself never ends)."""
        return len(self.order)

    def __iter__(self) -> "DistributedImageLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._batches is None or self._left == 0:
            rows = self.order.rows()
            self._sampler.keys, self._left = np.stack([rows, self._epoch_item_seeds()[rows]], axis=-1), len(rows)
            self._batches = iter(self._loader)  # with persistent workers: the same workers, in-flight batches dropped
        try:
            batch = next(self._batches)
        except BaseException:
            self._batches = None  # a retry restarts at this same batch rather than the one after it
            raise
        self._left -= 1
        self.order.advance()
        return batch

    def _epoch_item_seeds(self) -> np.ndarray:
        """Every sample's augmentation seed for the current epoch, by sample index; cached per epoch."""
        if self._seeds_epoch != self.order.epoch:
            generator = np.random.default_rng([self.seed, self.order.epoch, _AUGMENT_STREAM])
            self._item_seeds, self._seeds_epoch = generator.integers(2**63, size=len(self.dataset)), self.order.epoch
        return self._item_seeds

    def state_dict(self) -> dict[str, int]:
        """The position plus what must match for it to mean the same batches on resume."""
        return self.order.state_dict() | {"seed": self.seed, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        check_same_data(state, self.state_dict())
        self.order.load_state_dict(state)
        self._batches = None

    def close(self) -> None:
        """Stop the worker processes now (they would otherwise stop when the loader is garbage-collected)."""
        self._batches = None
        # The DataLoader keeps its iterator (which owns the workers) while they persist; torch has no public
        # call to stop them short of dropping every reference and waiting for garbage collection.
        iterator, self._loader._iterator = self._loader._iterator, None
        if iterator is not None:
            iterator._shutdown_workers()


def image_validation_batches(
    samples: Sequence[Sample],
    transform: Transform,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    max_batches: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's validation batches: the same every call, in a fixed order.

    Unlike the text ``validation_batches``, every sample is covered exactly once across the ranks
    (without ``max_batches``), so top-1/top-5 over a whole validation set are exact: rank ``r``
    gets the ``r``-th contiguous slice (slice lengths differ by at most one) and its last batch may
    be smaller. Ranks may therefore run different numbers of batches: sum correct counts and sample
    counts locally and reduce them once at the end, not per batch. ``max_batches`` caps each rank's
    batches. Item ``i`` is seeded with ``i``, so even a random transform gives the same batches.
    """
    if micro_batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size and micro_batch_size >= 1, got {rank}, {world_size}, {micro_batch_size}")
    start, stop = rank * len(samples) // world_size, (rank + 1) * len(samples) // world_size
    batches = [[(index - start, index) for index in range(first, min(first + micro_batch_size, stop))] for first in range(start, stop, micro_batch_size)][
        :max_batches
    ]
    if not batches:
        return
    dataset = ImageDataset(samples[start:stop], transform)
    yield from _data_loader(dataset, batches, num_workers, pin_memory, prefetch_factor=2, persistent=False)
