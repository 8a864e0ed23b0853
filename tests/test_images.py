"""zoa_train.data.images: the digits tree, ImageFolder scanning, transforms, the distributed image loader, validation batches."""

import itertools
import multiprocessing
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np
import pytest
import torch
from conftest import one_sentence
from PIL import Image

from zoa_train.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DistributedImageLoader,
    ImageDataset,
    ImageFolderData,
    UnreadableImage,
    eval_transform,
    image_validation_batches,
    prepare_digits,
    scan_image_folder,
    train_transform,
)
from zoa_train.errors import UserError


def raw_pixels(image: Image.Image) -> torch.Tensor:
    """No augmentation: the image's own bytes as float CHW, so a batch shows which files it holds."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float()


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """The id written into pixel (0, 0) of each image by ``image_folder`` (needs ``raw_pixels``)."""
    return batch["pixel_values"][:, 0, 0, 0].long().tolist()


def write_png(path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, mode="RGB").save(path)


@pytest.fixture(scope="module")
def digits_root(cache_dir):
    return prepare_digits(cache_dir)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """40 noisy 8x8 RGB images in 4 classes; image ``i`` has ``i`` in the red channel of its top-left pixel."""
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for i in range(40):
        pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        pixels[0, 0, 0] = i
        write_png(root / f"c{i % 4}" / f"{i:03d}.png", pixels)
    samples, _ = scan_image_folder(root)
    return samples


def take(loader, count: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(count)]


def assert_same_batches(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.keys() == e.keys() == {"pixel_values", "labels"}
        assert torch.equal(a["pixel_values"], e["pixel_values"]) and torch.equal(a["labels"], e["labels"])


# --- the bundled digits -------------------------------------------------------------------------


def test_digits_tree_has_every_digit_split_by_class(digits_root):
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = ImageFolderData.scan(digits_root)
    assert data.classes == [str(d) for d in range(10)]
    assert len(data.train) + len(data.val) == 1797
    train_counts = np.bincount([label for _, label in data.train], minlength=10)
    val_counts = np.bincount([label for _, label in data.val], minlength=10)
    assert val_counts.sum() == 360 and np.abs(val_counts - (train_counts + val_counts) * 0.2).max() < 1  # stratified 20%
    assert np.array_equal(train_counts + val_counts, np.bincount(digits.target))
    # file NNNN.png is load_digits() image NNNN, filed under its label, 0..16 mapped to 0..255 and upscaled
    first = next(p for p in (digits_root / "train" / str(digits.target[0]), digits_root / "val" / str(digits.target[0])) if (p / "0000.png").exists())
    with Image.open(first / "0000.png") as image:
        assert image.mode == "RGB" and image.size == (32, 32)
        pixels = np.array(image)
    expected = Image.fromarray(np.rint(digits.images[0] * 255 / 16).astype(np.uint8), mode="L").resize((32, 32), Image.Resampling.BICUBIC)
    assert np.array_equal(pixels[..., 0], np.array(expected)) and np.array_equal(pixels[..., 0], pixels[..., 2])
    assert pixels.max() > 200 and pixels.min() == 0


def test_digits_are_reused_and_split_the_same_way_elsewhere(digits_root, tmp_path):
    marker = digits_root / "train" / "0"
    before = (digits_root.stat().st_mtime_ns, marker.stat().st_mtime_ns, sorted(p.name for p in marker.iterdir()))
    assert prepare_digits(digits_root.parents[1]) == digits_root
    assert (digits_root.stat().st_mtime_ns, marker.stat().st_mtime_ns, sorted(p.name for p in marker.iterdir())) == before
    with ThreadPoolExecutor(3) as pool:  # three "ranks" at once: one builds, the others wait for it (flock is per open file)
        roots = list(pool.map(prepare_digits, [tmp_path] * 3))
    other = roots[0]
    assert roots == [other] * 3 and other != digits_root
    for split in ("train", "val"):
        files = {p.relative_to(digits_root / split) for p in (digits_root / split).rglob("*.png")}
        assert files == {p.relative_to(other / split) for p in (other / split).rglob("*.png")}
    assert not list(tmp_path.glob("images/.*tmp*"))  # the temporary build directory was renamed into place


# --- scanning -----------------------------------------------------------------------------------


def test_scan_finds_images_of_any_extension_case_in_sorted_classes(tmp_path):
    write_png(tmp_path / "b" / "one.png", np.zeros((4, 4, 3), np.uint8))
    (tmp_path / "a").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "a" / "n01.JPEG", format="JPEG")  # ImageNet's upper-case extension
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    samples, classes = scan_image_folder(tmp_path)
    assert classes == ["a", "b"]
    assert samples == [(str(tmp_path / "a" / "n01.JPEG"), 0), (str(tmp_path / "b" / "one.png"), 1)]


def test_scan_errors_are_one_sentence_naming_the_path(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(UserError, match=re.escape(f"Image folder {missing} does not exist.")):
        scan_image_folder(missing)

    flat = tmp_path / "flat"
    write_png(flat / "image.png", np.zeros((4, 4, 3), np.uint8))  # an image, but not in a class folder
    with pytest.raises(UserError, match="no class subfolders") as error:
        scan_image_folder(flat)
    one_sentence(str(error.value), str(flat))

    no_images = tmp_path / "no_images"
    for name in ("a", "b"):
        (no_images / name).mkdir(parents=True)
        (no_images / name / "readme.txt").write_text("text")
    with pytest.raises(UserError, match="has no image files in its class subfolders") as error:
        scan_image_folder(no_images)
    one_sentence(str(error.value), str(no_images))

    one_empty = tmp_path / "one_empty"
    write_png(one_empty / "full" / "x.png", np.zeros((4, 4, 3), np.uint8))
    (one_empty / "hollow").mkdir()
    with pytest.raises(UserError, match=re.escape(f"Class folder {one_empty / 'hollow'} has no image files")) as error:
        scan_image_folder(one_empty)
    one_sentence(str(error.value), str(one_empty / "hollow"))


def test_train_and_val_must_have_the_same_classes(tmp_path):
    for split, classes in (("train", "ab"), ("val", "a")):
        for name in classes:
            write_png(tmp_path / split / name / "x.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(UserError, match="only in train: b") as error:
        ImageFolderData.scan(tmp_path)
    one_sentence(str(error.value), str(tmp_path / "val"))


# --- transforms ---------------------------------------------------------------------------------


def test_transforms_give_normalised_float_chw(tmp_path):
    white = Image.new("RGB", (50, 40), (255, 255, 255))
    pixels = eval_transform(resize_size=36, crop_size=32)(white)
    assert pixels.dtype == torch.float32 and pixels.shape == (3, 32, 32) and type(pixels) is torch.Tensor
    expected = (1 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(pixels, expected[:, None, None].expand(3, 32, 32))
    crop = train_transform(crop_size=24)(white)
    assert crop.dtype == torch.float32 and crop.shape == (3, 24, 24) and type(crop) is torch.Tensor
    with pytest.raises(UserError, match="at least the crop_size"):
        eval_transform(resize_size=16, crop_size=32)


def test_augmentation_is_a_function_of_the_item_seed(image_folder):
    dataset = ImageDataset(image_folder, train_transform(crop_size=8, min_scale=0.3))
    first, label = dataset[(5, 123)]
    assert label == image_folder[5][1]
    torch.manual_seed(0)  # the caller's generator state does not matter...
    again, _ = dataset[(5, 123)]
    torch.manual_seed(99)
    assert torch.equal(first, dataset[(5, 123)][0]) and torch.equal(first, again)
    state = torch.get_rng_state()
    others = [dataset[(5, seed)][0] for seed in range(124, 130)]
    assert torch.equal(torch.get_rng_state(), state)  # ...and is left as it was
    assert all(not torch.equal(first, other) for other in others)


# --- the distributed loader ---------------------------------------------------------------------


def test_ranks_split_each_global_batch(image_folder):
    ranks = [DistributedImageLoader(image_folder, raw_pixels, 4, rank=r, world_size=3, seed=7) for r in range(3)]
    single = DistributedImageLoader(image_folder, raw_pixels, 12, seed=7)
    assert len(single) == len(ranks[0]) == 3  # 40 // 12: 4 images left out each epoch
    seen_per_epoch = []
    for _ in range(6):  # two epochs
        parts = [next(loader) for loader in ranks]
        ids = [sample_ids(part) for part in parts]
        assert all(len(part) == 4 for part in ids) and len(set(itertools.chain(*ids))) == 12  # disjoint
        assert_same_batches([{k: torch.cat([p[k] for p in parts]) for k in parts[0]}], [next(single)])
        seen_per_epoch.append(set(itertools.chain(*ids)))
    assert len(seen_per_epoch[0] | seen_per_epoch[1] | seen_per_epoch[2]) == 36
    assert [sorted(s) for s in seen_per_epoch[:3]] != [sorted(s) for s in seen_per_epoch[3:]]  # reshuffled


def test_augmented_global_batch_is_the_same_at_any_world_size(image_folder):
    transform = train_transform(crop_size=8, min_scale=0.3)
    ranks = [DistributedImageLoader(image_folder, transform, 5, rank=r, world_size=2, seed=3) for r in range(2)]
    single = DistributedImageLoader(image_folder, transform, 10, seed=3)
    for _ in range(5):  # past the epoch boundary (4 batches an epoch)
        parts = [next(loader) for loader in ranks]
        assert_same_batches([{k: torch.cat([p[k] for p in parts]) for k in parts[0]}], [next(single)])


def global_batches(samples, layout, steps: int, state=None, transform=raw_pixels) -> list[dict[str, torch.Tensor]]:
    """`steps` global batches of 12 as the ranks of `layout` (world size, micro-batch size) take them:
    each rank's micro-batches in order, rank after rank."""
    world, micro = layout
    loaders = [DistributedImageLoader(samples, transform, micro, rank=r, world_size=world, seed=7, global_batch_size=12) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    taken = [[take(loader, 12 // (world * micro)) for loader in loaders] for _ in range(steps)]
    return [{k: torch.cat([b[k] for rank in step for b in rank]) for k in ("pixel_values", "labels")} for step in taken], loaders


@pytest.mark.parametrize("layout", [(2, 3), (3, 2), (1, 4)], ids=lambda x: f"{x}")
def test_with_accumulation_a_global_batch_and_a_position_mean_the_same_at_any_layout(image_folder, layout):
    transform = train_transform(crop_size=8, min_scale=0.3)
    reference, _ = global_batches(image_folder, (1, 12), 7, transform=transform)  # 3 global batches an epoch: into the third epoch
    steps, _ = global_batches(image_folder, layout, 7, transform=transform)
    assert_same_batches(steps, reference)  # the same images in the same order, augmented alike
    ids = [sample_ids(step) for step in global_batches(image_folder, layout, 3)[0]]
    assert len(set(itertools.chain(*ids))) == 36  # an epoch: no image twice
    for taken in (2, 3):  # inside an epoch, at its end
        _, loaders = global_batches(image_folder, (2, 3), taken, transform=transform)
        continued, _ = global_batches(image_folder, layout, 7 - taken, state=loaders[1].state_dict(), transform=transform)
        assert_same_batches(continued, reference[taken:])


@pytest.fixture(scope="module")
def uninterrupted(image_folder):
    """Seven batches (an epoch is five) of the augmented loader without workers, taken in one go."""
    loader = DistributedImageLoader(image_folder, train_transform(crop_size=8, min_scale=0.3), 8, seed=11)
    return take(loader, 7)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact_and_independent_of_workers(image_folder, uninterrupted, num_workers):
    transform = train_transform(crop_size=8, min_scale=0.3)
    with closing(DistributedImageLoader(image_folder, transform, 8, seed=11, num_workers=num_workers)) as first:
        assert_same_batches(take(first, 3), uninterrupted[:3])
        state = first.state_dict()  # the workers have prefetched beyond batch 3; the state is what was taken
    assert state == {"epoch": 0, "sample": 24, "micro": 0, "world_size": 1, "micro_batch_size": 8, "global_batch_size": 8, "seed": 11, "num_samples": 40}
    with closing(DistributedImageLoader(image_folder, transform, 8, seed=11, num_workers=num_workers)) as resumed:
        resumed.load_state_dict(state)
        assert_same_batches(take(resumed, 4), uninterrupted[3:])
        assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["sample"] == 16
        resumed.load_state_dict(state)  # rewinding mid-run drops the batches already in flight
        assert_same_batches(take(resumed, 1), uninterrupted[3:4])


def test_loader_leaves_the_global_generator_alone_and_close_stops_workers(image_folder):
    before = set(multiprocessing.active_children())
    loader = DistributedImageLoader(image_folder, train_transform(crop_size=8), 8, num_workers=2)
    state = torch.get_rng_state()
    take(loader, 6)  # crosses an epoch: the same workers are reused
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2 and torch.equal(torch.get_rng_state(), state)
    loader.close()
    assert not any(worker.is_alive() for worker in workers)
    no_workers = DistributedImageLoader(image_folder, train_transform(crop_size=8), 8)
    take(no_workers, 6)
    assert torch.equal(torch.get_rng_state(), state)


def test_resume_checks_and_too_little_data(image_folder):
    state = DistributedImageLoader(image_folder, raw_pixels, 4, seed=1).state_dict()
    with pytest.raises(UserError, match=r"checkpoint has seed=1 and this run 2"):
        DistributedImageLoader(image_folder, raw_pixels, 4, seed=2).load_state_dict(state)
    inside = DistributedImageLoader(image_folder, raw_pixels, 2, seed=1, global_batch_size=4)
    take(inside, 1)
    with pytest.raises(UserError, match=r"with world_size 1 \(now 2\), micro_batch_size 2 \(now 4\), global_batch_size 4 \(now 8\): its position lies inside"):
        DistributedImageLoader(image_folder, raw_pixels, 4, rank=1, world_size=2, seed=1).load_state_dict(inside.state_dict())
    with pytest.raises(UserError, match=r"checkpoint has num_samples=40 and this run 39"):
        DistributedImageLoader(image_folder[:39], raw_pixels, 4, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match=r"has 40 images, fewer than a global batch of 48"):
        DistributedImageLoader(image_folder, raw_pixels, 16, world_size=3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_image_stops_with_its_path(tmp_path, num_workers):
    write_png(tmp_path / "a" / "good.png", np.zeros((8, 8, 3), np.uint8))
    bad = tmp_path / "a" / "x.png"
    bad.write_bytes(b"\x00garbage, not a PNG\xff" * 8)
    samples, _ = scan_image_folder(tmp_path)
    loader = DistributedImageLoader(samples, raw_pixels, 2, num_workers=num_workers)
    with pytest.raises(UnreadableImage) as error:
        next(loader)
    expected = f"Image file {bad} is corrupt or unreadable (not a recognised image format); replace or delete it, then resume the run."
    assert str(error.value) == expected and isinstance(error.value, UserError)
    assert loader.state_dict()["sample"] == 0  # the failed batch was not consumed
    loader.close()


def test_truncated_image_is_unreadable_too(tmp_path):
    whole = tmp_path / "whole.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(whole)
    cut = tmp_path / "a" / "cut.png"
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[:2000])
    dataset = ImageDataset([(str(cut), 0)], raw_pixels)
    with pytest.raises(UnreadableImage, match=re.escape(f"Image file {cut} is corrupt or unreadable (")) as error:
        dataset[(0, 0)]
    one_sentence(str(error.value), str(cut))


def test_worker_wrapped_message_is_unwrapped():
    sentence = "Image file /data/n01/x.JPEG is corrupt or unreadable (broken data stream); replace or delete it, then resume the run."
    wrapped = (
        "Caught UnreadableImage in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
        '  File "worker.py", line 1, in _worker_loop\n    data = fetcher.fetch(index)\n'
        f"zoa_train.data.images.UnreadableImage: {sentence}\n"
    )
    assert str(UnreadableImage(wrapped)) == sentence
    assert str(UnreadableImage(sentence)) == sentence


# --- validation ---------------------------------------------------------------------------------


def test_validation_covers_every_sample_once_across_ranks(image_folder):
    samples = image_folder[:10]
    per_rank = [list(image_validation_batches(samples, raw_pixels, 2, rank=r, world_size=3)) for r in range(3)]
    ids = [[i for batch in batches for i in sample_ids(batch)] for batches in per_rank]
    expected = [int(Image.open(path).getpixel((0, 0))[0]) for path, _ in samples]
    assert ids == [expected[0:3], expected[3:6], expected[6:10]]  # contiguous slices, in order
    assert [[len(b["labels"]) for b in batches] for batches in per_rank] == [[2, 1], [2, 1], [2, 2]]
    assert [label for batches in per_rank for b in batches for label in b["labels"].tolist()] == [label for _, label in samples]
    with_workers = list(image_validation_batches(samples, raw_pixels, 2, rank=2, world_size=3, num_workers=2))
    assert_same_batches(with_workers, per_rank[2])
    capped = [list(image_validation_batches(samples, raw_pixels, 2, rank=r, world_size=3, max_batches=1)) for r in range(3)]
    assert [len(batches) for batches in capped] == [1, 1, 1]
    assert_same_batches(capped[2], per_rank[2][:1])


def test_validation_with_a_random_transform_is_deterministic(image_folder):
    transform = train_transform(crop_size=8, min_scale=0.3)
    first = list(image_validation_batches(image_folder, transform, 8, rank=1, world_size=2))
    torch.manual_seed(1234)
    assert_same_batches(list(image_validation_batches(image_folder, transform, 8, rank=1, world_size=2)), first)
    assert [len(b["labels"]) for b in first] == [8, 8, 4]
