"""`zoa-train export`: real tiny runs (Gloo ranks on CPU) exported to Hugging Face directories and
loaded back with from_pretrained; the ranks' average for a checkpoint inside a local-step period;
one-sentence refusals that leave the output directory as it was."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from conftest import ROOT, ZOA, refused, zoa, zoa_here
from typer.testing import CliRunner

from zoa_train.cli import app
from zoa_train.errors import UserError
from zoa_train.evaluation import checkpoints
from zoa_train.evaluation.checkpoints import load_language_model
from zoa_train.evaluation.export import RECORD, export_language_model

SENTENCE = "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife."


# The two tiny runs, started together (they are mostly process start-up and rendezvous) in their own
# caches. gpt2: 0/1 Adam with local steps from step 1 on, so the step-2 checkpoint lies inside a local
# period (each rank saved its own parameters) and step 3 is the synchronised end of the run. bert:
# BertForPreTraining (masked LM + next-sentence head), one rank.
RUNS = {
    "gpt2": (
        "recipes/gpt2_tiny.yaml",
        2,
        [
            "optimizer.name=zero_one_adam",
            "optimizer.var_freeze_step=1",
            "optimizer.local_steps=fixed",
            "optimizer.local_step_interval=4",
            "train.checkpoint_every=2",
        ],
    ),
    "bert": ("recipes/bert_tiny.yaml", 1, ["model.next_sentence=true", "optimizer.name=adam", "train.steps=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    started = {}
    for name, (recipe, nproc, extra) in RUNS.items():
        sets = [
            "train.steps=3",
            "train.log_every=1",
            "train.val_every=0",
            "train.val_batches=1",
            "logging.wandb=disabled",
            "logging.tensorboard=false",
            f"data.cache_dir={cache_dir / name}",
            *extra,
        ]
        command = [
            *ZOA,  # started together, so not through zoa(), which waits
            "run",
            recipe,
            "--out",
            str(root / name),
            "--nproc",
            str(nproc),
            *[arg for s in sets for arg in ("--set", s)],
        ]
        with open(root / f"{name}.log", "w") as log:  # a file, not a pipe: neither run waits for a reader
            started[name] = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        for name, process in started.items():
            process.wait(timeout=600)
            assert process.returncode == 0, f"{name}: {(root / f'{name}.log').read_text()[-3000:]}"
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def gpt2_run(runs) -> Path:
    return runs["gpt2"]


@pytest.fixture(scope="module")
def bert_run(runs) -> Path:
    return runs["bert"]


def export(*args: str):
    """`zoa-train export ARGS` in this process (the subprocess tests below cover the entry point)."""
    result = CliRunner().invoke(app, ["export", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".export-" in p.name]


def assert_same_weights(model: torch.nn.Module, state: dict) -> None:
    exported = model.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_gpt2_round_trip(gpt2_run, tmp_path):
    out = tmp_path / "hf" / "gpt2"  # parents are created
    result = export(str(gpt2_run), str(out))
    assert "GPT2LMHeadModel" in result.output and "step 3" in result.output and "model.safetensors" in result.output
    assert "averaged" not in result.output
    assert leftovers(out.parent) == []
    record = json.loads((out / RECORD).read_text())
    assert record["checkpoint_step"] == 3 and record["model_kind"] == "gpt2" and record["averaged_ranks"] == 1
    assert record["source"] == str((gpt2_run / "checkpoints" / "step_00000003" / "model.pt").resolve())

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reference = load_language_model(gpt2_run)
    assert type(model).__name__ == "GPT2LMHeadModel" and reference.averaged_ranks == 1
    assert_same_weights(model, torch.load(gpt2_run / "checkpoints" / "step_00000003" / "model.pt"))
    ids = tokenizer(SENTENCE, return_tensors="pt")
    assert torch.equal(ids["input_ids"], reference.tokenizer(SENTENCE, return_tensors="pt")["input_ids"])
    assert ids["input_ids"].shape[1] > 5 and tokenizer.eos_token == reference.tokenizer.eos_token
    with torch.no_grad():
        logits, expected = model(**ids).logits, reference.model(**ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)

    generate = transformers.pipeline("text-generation", model=str(out))  # what pipelines and lm-eval do with the path
    assert generate("It is", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("It is")


@pytest.mark.slow
def test_bert_pretraining_round_trip(bert_run, tmp_path):
    out = tmp_path / "bert"
    export(str(bert_run / "checkpoints" / "step_00000002" / "model.pt"), str(out))  # the model-file form
    assert json.loads((out / RECORD).read_text())["architecture"] == "BertForPreTraining"
    model = transformers.AutoModelForPreTraining.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reference = load_language_model(bert_run)
    assert type(model).__name__ == type(reference.model).__name__ == "BertForPreTraining"
    assert_same_weights(model, torch.load(bert_run / "checkpoints" / "step_00000002" / "model.pt"))
    ids = tokenizer(SENTENCE, "She was the youngest of the two daughters.", return_tensors="pt")
    assert tokenizer.mask_token == "[MASK]" and ids["token_type_ids"].max() == 1
    with torch.no_grad():
        got, expected = model(**ids), reference.model(**ids)
    torch.testing.assert_close(got.prediction_logits, expected.prediction_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.seq_relationship_logits, expected.seq_relationship_logits, rtol=0, atol=1e-6)
    # The masked-LM head alone loads too (the next-sentence head is dropped).
    masked = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(masked(**ids).logits, expected.prediction_logits, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_inside_a_local_period_exports_the_ranks_average(gpt2_run, tmp_path):
    checkpoint = gpt2_run / "checkpoints" / "step_00000002"
    ranks = [torch.load(checkpoint / f"rank_0000{r}.pt", weights_only=False)["model"] for r in (0, 1)]
    assert any(not torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # the ranks did differ
    out = tmp_path / "averaged"
    result = export(str(checkpoint), str(out))
    assert "2 ranks" in result.output and "averaged" in result.output
    record = json.loads((out / RECORD).read_text())
    assert record["averaged_ranks"] == 2 and record["checkpoint_step"] == 2 and record["source"] == str(checkpoint.resolve())

    exported = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    rank0_model_pt = torch.load(checkpoint / "model.pt")
    for key in ranks[0]:
        mean = (ranks[0][key] + ranks[1][key]) / 2
        torch.testing.assert_close(exported[key], mean, rtol=1e-6, atol=1e-7, msg=key)
    assert any(not torch.equal(exported[k], rank0_model_pt[k]) for k in rank0_model_pt)


@pytest.mark.slow
def test_overwrite_replaces_and_a_failed_export_changes_nothing(gpt2_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    export(str(gpt2_run), str(out), "--overwrite")
    assert (out / "config.json").is_file() and not (out / "old.txt").exists() and leftovers(tmp_path) == []

    # A write that fails half-way (the disk fills while the tokenizer is saved): the previous export stays whole.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = checkpoints.load_language_model

    def failing_tokenizer(path, evaluation=None):
        loaded = real(path, evaluation)

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        loaded.tokenizer.save_pretrained = full
        return loaded

    monkeypatch.setattr(checkpoints, "load_language_model", failing_tokenizer)
    with pytest.raises(UserError, match="No space left on device"):
        export_language_model(gpt2_run, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("inside", [".", "checkpoints", "tokenizer", "checkpoints/step_00000003"])
def test_overwrite_never_replaces_what_the_export_reads(gpt2_run, inside):
    out = gpt2_run / inside
    before = sorted(str(p.relative_to(gpt2_run)) for p in gpt2_run.rglob("*"))
    with pytest.raises(UserError, match="holds the checkpoint being exported"):
        export_language_model(gpt2_run, out, overwrite=True)
    assert sorted(str(p.relative_to(gpt2_run)) for p in gpt2_run.rglob("*")) == before


def test_missing_checkpoint(tmp_path):
    done = zoa("export", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    refused(done, "nowhere", "no such file or directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_non_empty_out_dir_without_overwrite_is_left_alone(gpt2_run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = zoa("export", str(gpt2_run), str(out))
    refused(done, str(out), "not empty", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_resnet_run_is_refused(tmp_path):
    run = tmp_path / "resnet"
    checkpoint = run / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    shutil.copy(ROOT / "recipes" / "resnet18_tiny.yaml", run / "recipe.yaml")
    (checkpoint / "COMPLETE").write_text("step 1\nworld_size 1\n")
    torch.save({"fc.weight": torch.zeros(10, 512)}, checkpoint / "model.pt")
    done = zoa("export", str(run), str(tmp_path / "out"))
    refused(done, "resnet18", "needs a run of a language model (GPT-2, BERT, Llama, Hugging Face causal LM)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet"]


@pytest.mark.slow
def test_a_checkpoint_that_rotation_removes_while_it_is_read_gives_way_to_the_newest(gpt2_run, tmp_path, monkeypatch, caplog):
    """A run still training writes step 5 and its rotation removes step 3 right after export chose step 3:
    the export reads the newest complete checkpoint once more (its files then held open) and says so."""
    from zoa_train.train import rundir

    run = tmp_path / "run"
    shutil.copytree(gpt2_run, run)
    chosen = []

    def rotated_meanwhile(path):
        model_file, found_run = rundir_resolve(path)
        if not chosen:
            checkpoint = model_file.parent
            newer = checkpoint.with_name("step_00000005")
            shutil.copytree(checkpoint, newer)
            marker = newer / "COMPLETE"
            marker.write_text(marker.read_text().replace("step 3\n", "step 5\n"))
            shutil.rmtree(checkpoint)
        chosen.append(model_file.parent.name)
        return model_file, found_run

    rundir_resolve = rundir.resolve_model_file
    monkeypatch.setattr(rundir, "resolve_model_file", rotated_meanwhile)
    result = export_language_model(run, tmp_path / "hf")
    assert chosen == ["step_00000003", "step_00000005"] and result.step == 5
    assert f"checkpoint {run / 'checkpoints' / 'step_00000003'} was removed while it was being read" in caplog.text
    assert json.loads((tmp_path / "hf" / RECORD).read_text())["checkpoint_step"] == 5


def gpt2_tiny_run(tmp: Path, recipe_n_layer: int = 2) -> Path:
    """A run directory as `zoa-train run recipes/gpt2_tiny.yaml` leaves it for export and eval: the recipe,
    a trained tokenizer and a complete checkpoint of gpt2_tiny's 2-layer model (untrained weights). With
    `recipe_n_layer` 3, its recipe.yaml was edited after the run wrote it."""
    from zoa_train.config import load_recipe
    from zoa_train.data.tokenizer import load_or_train_tokenizer
    from zoa_train.models import ModelInputs, create

    run = tmp / "run"
    checkpoint = run / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    tokenizer = load_or_train_tokenizer("gpt2", None, [SENTENCE] * 20, 300, tmp / "trained-tokenizer")
    tokenizer.save_pretrained(run / "tokenizer")
    shutil.rmtree(tmp / "trained-tokenizer")
    (tmp / "trained-tokenizer.lock").unlink(missing_ok=True)
    recipe = load_recipe(ROOT / "recipes" / "gpt2_tiny.yaml")
    torch.save(create(recipe.model, ModelInputs.of_tokenizer(tokenizer, recipe.data.seq_len)).state_dict(), checkpoint / "model.pt")
    (checkpoint / "COMPLETE").write_text("step 1\nworld_size 1\n")
    (run / "recipe.yaml").write_text((ROOT / "recipes" / "gpt2_tiny.yaml").read_text().replace("n_layer: 2", f"n_layer: {recipe_n_layer}"))
    return run


def test_a_checkpoint_its_recipe_no_longer_describes_is_refused_naming_what_differs(tmp_path, capsys):
    run = gpt2_tiny_run(tmp_path)
    assert type(load_language_model(run).model).__name__ == "GPT2LMHeadModel"  # the recipe as the run wrote it rebuilds the model
    edited = gpt2_tiny_run(tmp_path / "edited", recipe_n_layer=3)
    done = zoa_here(capsys, "export", str(edited), str(tmp_path / "out"))
    refused(done)
    model_file = edited / "checkpoints" / "step_00000001" / "model.pt"
    assert done.stderr.strip() == (
        f"error: {model_file} does not fit the model that {edited / 'recipe.yaml'} describes (12 tensors missing, 0 extra, 0 of another shape; "
        "transformer.h.2.ln_1.weight is not in the file); recipe.yaml was changed after the run wrote it: put back the one the run wrote."
    )
    assert not (tmp_path / "out").exists()
