"""`zoa-train eval imagenet` against a direct computation, alone and split over torchrun ranks."""

import json
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import TORCHRUN, refused, zoa
from PIL import Image

from zoa_train.data.images import eval_transform, scan_image_folder


@pytest.fixture(scope="module")
def val_folder(tmp_path_factory) -> Path:
    """Three classes of 5, 4 and 4 random 40x30 images (13: the two ranks get unequal slices)."""
    root = tmp_path_factory.mktemp("val")
    generator = torch.Generator().manual_seed(0)
    for name, count in (("cat", 5), ("dog", 4), ("fox", 4)):
        (root / name).mkdir()
        for i in range(count):
            pixels = (torch.rand(30, 40, 3, generator=generator) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / name / f"{i}.JPEG")
    return root


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    torch.manual_seed(1)
    model = torchvision.models.resnet18(num_classes=3)
    with torch.no_grad():  # BatchNorm statistics away from their initial values, as after training
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("model") / "model.pt"
    torch.save(model.state_dict(), path)
    return path


def direct(model_file: Path, val_folder: Path) -> dict:
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(torch.load(model_file))
    model.eval()
    transform = eval_transform(36, 32)
    samples, _ = scan_image_folder(val_folder)
    pixels = torch.stack([transform(Image.open(path).convert("RGB")) for path, _ in samples])
    labels = torch.tensor([label for _, label in samples])
    with torch.no_grad():
        logits = model(pixels)
    top = logits.topk(3, dim=1).indices
    return {
        "top1": (top[:, 0] == labels).double().mean().item(),
        "top5": (top == labels[:, None]).any(dim=1).double().mean().item(),
        "loss": torch.nn.functional.cross_entropy(logits, labels).item(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_eval_imagenet_equals_a_direct_computation(tmp_path, model_file, val_folder, ranks):
    out = tmp_path / "eval.json"
    args = (
        "eval",
        "imagenet",
        "--checkpoint",
        str(model_file),
        "--data",
        str(val_folder),
        "--batch-size",
        "4",
        "--workers",
        str(ranks - 1),
        "--resize-size",
        "36",
        "--crop-size",
        "32",
        "--json",
        str(out),
    )
    done = zoa(*args, command=TORCHRUN) if ranks == 2 else zoa(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    result, expected = json.loads(out.read_text()), direct(model_file, val_folder)
    assert result["images"] == 13 and result["classes"] == 3
    assert result["top1"] == pytest.approx(expected["top1"], abs=1e-12) and result["top5"] == 1.0
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert "top-1" in done.stdout


def test_eval_imagenet_bad_input_is_one_sentence(tmp_path, model_file, val_folder):
    cases = {
        "missing data": (["--checkpoint", str(model_file), "--data", str(tmp_path / "nope")], "does not exist"),
        "missing checkpoint": (["--checkpoint", str(tmp_path / "none.pt"), "--data", str(val_folder)], "no such file or directory"),
        "not a model": (["--checkpoint", str(val_folder / "cat" / "0.JPEG"), "--data", str(val_folder)], "is not a resnet18 model file"),
        "empty run dir": (["--checkpoint", str(tmp_path), "--data", str(val_folder)], "is neither a run directory"),
    }
    for args, message in cases.values():
        refused(zoa("eval", "imagenet", *args, "--workers", "0"), message)

    broken = tmp_path / "broken"
    (broken / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(broken / "cat" / "good.png")
    (broken / "cat" / "bad.png").write_bytes(b"not an image at all")
    done = zoa("eval", "imagenet", "--checkpoint", str(model_file), "--data", str(broken), "--workers", "1")
    refused(done, "bad.png")
