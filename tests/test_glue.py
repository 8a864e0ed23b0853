"""`zoa-train eval glue`: run_glue's metrics against independent formulas, the readers on files in
each GLUE task's original format, fine-tuning a tiny BERT run to high accuracy on a learnable
task (alone and under torchrun), and bad input as one sentence with exit code 2."""

import json
import os
import random
import re
import subprocess
from pathlib import Path

import conftest
import numpy as np
import pytest
import torch
from conftest import TORCHRUN, ZOA, refused, zoa_here

from zoa_train import files
from zoa_train.errors import UserError
from zoa_train.evaluation import glue, glue_tasks

FAST = ["--set", "finetune.lr=1e-3", "--set", "finetune.epochs=4", "--set", "finetune.seq_len=16", "--set", "finetune.batch_size=16"]


def zoa(*args: str, command=ZOA) -> subprocess.CompletedProcess:
    # One thread per process (torchrun sets the same): on a machine whose cores are busy with other
    # work, torch's default of one thread per core can make these small models many times slower.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return conftest.zoa(*args, command=command, env=env)


# ---- metrics against independent computations ----------------------------------------------------


def ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        r[tied] = r[tied].mean()
    return r


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


def binary_counts(pred, gold):
    tp = float(np.sum((pred == 1) & (gold == 1)))
    tn = float(np.sum((pred == 0) & (gold == 0)))
    fp = float(np.sum((pred == 1) & (gold == 0)))
    fn = float(np.sum((pred == 0) & (gold == 1)))
    return tp, tn, fp, fn


def test_metrics_match_independent_formulas():
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 2, 200)
    pred = np.where(rng.random(200) < 0.7, gold, 1 - gold)  # about 70% right
    tp, tn, fp, fn = binary_counts(pred, gold)

    mcc = (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert glue_tasks.glue_metrics("cola", pred, gold) == pytest.approx({"matthews_correlation": mcc}, abs=1e-12)

    accuracy = (tp + tn) / len(gold)
    f1 = 2 * tp / (2 * tp + fp + fn)
    for task in ("mrpc", "qqp"):
        assert glue_tasks.glue_metrics(task, pred, gold) == pytest.approx({"accuracy": accuracy, "f1": f1}, abs=1e-12)
    for task in ("sst2", "qnli", "rte", "wnli"):
        assert glue_tasks.glue_metrics(task, pred, gold) == pytest.approx({"accuracy": accuracy}, abs=1e-12)

    three_gold = rng.integers(0, 3, 150)
    three_pred = np.where(rng.random(150) < 0.6, three_gold, rng.integers(0, 3, 150))
    acc3 = float(np.mean(three_pred == three_gold))
    assert glue_tasks.glue_metrics("mnli", three_pred, three_gold) == pytest.approx({"accuracy": acc3})
    assert glue_tasks.glue_metrics("mnli", three_pred, three_gold, "_mm") == pytest.approx({"accuracy_mm": acc3})

    scores = np.round(rng.uniform(0, 5, 120), 1)  # STS-B-like gold scores, with ties
    guesses = scores + rng.normal(0, 1.5, 120)
    expected = {"pearson": pearson(guesses, scores), "spearmanr": pearson(ranks(guesses), ranks(scores))}
    assert glue_tasks.glue_metrics("stsb", guesses, scores) == pytest.approx(expected, abs=1e-10)
    assert 0.3 < expected["spearmanr"] < 0.95  # not a degenerate case


def test_task_scores_and_the_glue_average_follow_the_leaderboard():
    # BERT-large's GLUE test results (Devlin et al., Table 1); the leaderboard's score is 80.5.
    bert_large = {
        "cola": {"matthews_correlation": 0.605},
        "sst2": {"accuracy": 0.949},
        "mrpc": {"f1": 0.893, "accuracy": 0.854},
        "stsb": {"pearson": 0.876, "spearmanr": 0.865},
        "qqp": {"f1": 0.721, "accuracy": 0.893},
        "mnli": {"accuracy": 0.867, "accuracy_mm": 0.859},
        "qnli": {"accuracy": 0.927},
        "rte": {"accuracy": 0.701},
        "wnli": {"accuracy": 0.651},
    }
    scores = {task: glue_tasks.task_score(task, metrics) for task, metrics in bert_large.items()}
    assert scores["mrpc"] == pytest.approx((0.893 + 0.854) / 2)
    assert scores["stsb"] == pytest.approx((0.876 + 0.865) / 2)
    assert scores["mnli"] == pytest.approx((0.867 + 0.859) / 2)
    assert round(100 * glue_tasks.glue_average(scores), 1) == 80.5
    assert glue_tasks.glue_average(scores, without=("wnli",)) == pytest.approx((sum(scores.values()) - scores["wnli"]) / 8)


def test_median_over_seeds():
    runs = [{"f1": 0.8, "accuracy": 0.7}, {"f1": 0.6, "accuracy": 0.9}, {"f1": 0.7, "accuracy": 0.8}]
    assert glue_tasks.median_metrics(runs) == pytest.approx({"f1": 0.7, "accuracy": 0.8})
    assert glue_tasks.median_metrics(runs[:2]) == pytest.approx({"f1": 0.7, "accuracy": 0.8})  # even: mean of the middle two
    assert glue_tasks.median_metrics([{"pearson": float("nan")}, {"pearson": 0.5}]) == {"pearson": 0.5}


def test_finetune_settings_are_typed_and_validated():
    cfg = glue.finetune_config(["finetune.lr=1e-4", "finetune.epochs=2", "finetune.seq_len=64", "finetune.warmup_ratio=0"])
    assert (cfg.lr, cfg.epochs, cfg.seq_len, cfg.warmup_ratio, cfg.batch_size, cfg.seed) == (1e-4, 2, 64, 0.0, 32, 0)
    assert isinstance(cfg.lr, float) and isinstance(cfg.warmup_ratio, float)
    assert glue.finetune_config() == glue.FinetuneConfig(2e-5, 3, 32, 128, 0.1, 0.01, 1.0, 0)
    for bad, words in [
        ("finetune.lrr=1", "did you mean finetune.lr"),
        ("finetune.epochs=2.5", "finetune.epochs must be int"),
        ("finetune.batch_size=0", "finetune.batch_size must be positive"),
        ("finetune.warmup_ratio=1.5", "finetune.warmup_ratio must be in [0, 1)"),
        ("finetune.lr", "must look like section.key=value"),
    ]:
        with pytest.raises(UserError, match=re.escape(words)):
            glue.finetune_config([bad])


# ---- readers on files in the original formats -----------------------------------------------------

QUOTED = '"Whose book is it? he asked'  # an opening quote with no closing one: must stay an ordinary character

FIXTURES = {
    "CoLA/train.tsv": f"gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.\n"
    f"gj04\t0\t*\tThey drank the pub.\ncj99\t1\t\t{QUOTED}\ncj99\t0\t*\tThe more we study verbs, the crazier they get get.\n",
    "CoLA/dev.tsv": "gj04\t1\t\tHe left.\ngj04\t0\t*\tLeft he the.\n",
    "SST-2/train.tsv": f"sentence\tlabel\nhide new secretions from the parental units \t0\n{QUOTED}\t1\nthe greatest musicians \t1\n",
    "SST-2/dev.tsv": "sentence\tlabel\nit 's a charming and often affecting journey . \t1\nunflinchingly bleak and desperate \t0\n",
    "MRPC/train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    '1\t702876\t702977\tAmrozi accused his brother , whom he called " the witness " , of deliberately distorting his evidence .\t'
    'Referring to him as only " the witness " , Amrozi accused his brother of deliberately distorting his evidence .\n'
    "0\t2108705\t2108831\tYucaipa owned Dominick 's before selling the chain to Safeway in 1998 for $ 2.5 billion .\t"
    "Yucaipa bought Dominick 's in 1995 for $ 693 million and sold it to Safeway for $ 1.8 billion in 1998 .\n",
    "MRPC/dev.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1355540\t1355592\tHe said the foodservice pie business doesn 't fit .\tThe foodservice pie business did not fit , he said .\n",
    "STS-B/train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
    "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a large flute.\tA man is playing a flute.\t3.800\n",
    "STS-B/dev.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat is dancing.\tA man wearing a hard hat is dancing.\t5.000\n"
    "1\tmain-captions\tMSRvid\t2012test\t0002\tnone\tnone\tA young child is riding a horse.\tA child is riding a horse.\t4.750\n",
    "QQP/train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    "133273\t213221\t213222\tHow is the life of a math student?\tWhich level of prepration is enough?\t0\n"
    "402555\t536040\t536041\tHow do I control my horny emotions?\tHow do you control your horniness?\t1\n"
    "363362\t493340\t493341\tA truncated row\n",
    "QQP/dev.tsv": 'id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t2\t3\tWhy are "quotes" fine?\tAre quotes fine?\t1\n',
    "QNLI/train.tsv": "index\tquestion\tsentence\tlabel\n0\tWhen did the third Digimon series begin?\tUnlike the two seasons before it, it is set in the real world.\tnot_entailment\n"
    "1\tWhich missile batteries often have individual launchers?\tWhen MANPADS is operated by specialists, batteries may have dozens of teams.\tentailment\n",
    "QNLI/dev.tsv": "index\tquestion\tsentence\tlabel\n0\tWhat came into force after the new constitution?\tThe Treaty came into force.\tentailment\n",
    "RTE/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons of Mass Destruction Found in Iraq.\tnot_entailment\n",
    "RTE/dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tDana Reeve died of lung cancer.\tChristopher Reeve had an accident.\tnot_entailment\n"
    "1\tYet, we now are discovering that antibiotics are losing their effectiveness.\tBacteria is winning the war against antibiotics.\tentailment\n",
    "WNLI/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tI stuck a pin through a carrot. When I pulled the pin out, it had a hole.\tThe carrot had a hole.\t1\n",
    "WNLI/dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tThe drain is clogged with hair. It has to be cleaned.\tThe hair has to be cleaned.\t0\n",
}
MNLI_TRAIN_HEADER = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER.replace("label1\t", "label1\tlabel2\tlabel3\tlabel4\tlabel5\t")


def mnli_row(index: int, premise: str, hypothesis: str, labels: list[str]) -> str:
    parse = "( ( x ) )"
    return "\t".join([str(index), "31193", f"{index}n", "government", parse, parse, f"(ROOT {parse})", f"(ROOT {parse})", premise, hypothesis, *labels]) + "\n"


FIXTURES |= {
    "MNLI/train.tsv": MNLI_TRAIN_HEADER
    + mnli_row(0, "Conceptually cream skimming has two basic dimensions.", "Product and geography are what make cream skimming work.", ["neutral", "neutral"])
    + mnli_row(1, "you know during the season", "You lose the things to the following level.", ["entailment", "entailment"]),
    "MNLI/dev_matched.tsv": MNLI_DEV_HEADER
    + mnli_row(0, "The new rights are nice enough", "Everyone really likes the newest benefits", ["neutral"] * 5 + ["neutral"])
    + mnli_row(
        1,
        "This site includes a list of all award winners.",
        "The Government Executive articles are not on the site.",
        ["contradiction"] * 5 + ["contradiction"],
    ),
    "MNLI/dev_mismatched.tsv": MNLI_DEV_HEADER
    + mnli_row(
        0,
        'Your contribution helped make it possible for us to provide "scholarships".',
        "Your contributions were of no help.",
        ["contradiction"] * 5 + ["contradiction"],
    )
    + mnli_row(
        1,
        "The answer has nothing to do with their cause.",
        "Their cause is not related to the answer.",
        ["entailment", "neutral", "entailment", "entailment", "entailment", "entailment"],
    ),
}


def write_glue(root: Path, files: dict[str, str] = FIXTURES) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory) -> Path:
    return write_glue(tmp_path_factory.mktemp("glue_data"))


def test_readers_take_each_task_in_its_original_format(glue_dir):
    data = {task: glue_tasks.load_task_data(glue_dir, task) for task in glue_tasks.TASKS}
    cola = data["cola"].train
    assert cola.labels == [1, 0, 1, 0] and cola.text_b is None
    assert cola.text_a[0] == "Our friends won't buy this analysis, let alone the next one we propose."
    assert cola.text_a[2] == QUOTED  # QUOTE_NONE: the quote is kept, the next row is a row of its own
    sst2 = data["sst2"].train
    assert sst2.labels == [0, 1, 1] and sst2.text_a[1] == QUOTED and sst2.text_a[2] == "the greatest musicians "
    mrpc = data["mrpc"]
    assert mrpc.train.labels == [1, 0] and mrpc.dev[""].labels == [1]  # the byte-order mark did not hide "Quality"
    assert mrpc.train.text_a[0].startswith('Amrozi accused his brother , whom he called " the witness "')
    assert mrpc.train.text_b[1].startswith("Yucaipa bought Dominick 's in 1995")
    stsb = data["stsb"]
    assert stsb.train.labels == [5.0, 3.8] and stsb.train.text_a[1] == "A man is playing a large flute." and stsb.train.text_b[1] == "A man is playing a flute."
    qqp = data["qqp"]
    assert qqp.train.labels == [0, 1] and qqp.train.skipped == 1  # the truncated row is left out, and counted
    assert qqp.dev[""].text_a == ['Why are "quotes" fine?']
    mnli = data["mnli"]
    assert mnli.train.labels == [1, 0]  # entailment 0, neutral 1, contradiction 2: gold_label, the last column
    assert set(mnli.dev) == {"", "_mm"}
    assert mnli.dev[""].labels == [1, 2] and mnli.dev[""].text_b[0] == "Everyone really likes the newest benefits"
    assert mnli.dev["_mm"].labels == [2, 0] and mnli.dev["_mm"].text_a[0].endswith('"scholarships".')
    assert data["qnli"].train.labels == [1, 0] and data["qnli"].train.text_a[0] == "When did the third Digimon series begin?"
    assert data["rte"].dev[""].labels == [1, 0] and data["rte"].dev[""].text_b[1] == "Bacteria is winning the war against antibiotics."
    assert data["wnli"].train.labels == [1] and data["wnli"].dev[""].labels == [0]


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("SST-2/dev.tsv", "text\tlabel\nfine\t1\n", "expected a tab-separated header with sentence, label, found text, label"),
        ("CoLA/dev.tsv", "sentence\tlabel\nHe left.\t1\n", "without a header (source, label, original label mark, sentence)"),
        ("MNLI/dev_matched.tsv", MNLI_DEV_HEADER.replace("\tgold_label", ""), "gold_label last"),
        (
            "RTE/dev.tsv",
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tneutral\n",
            "line 2: the RTE label must be one of entailment, not_entailment, not 'neutral'",
        ),
    ],
)
def test_readers_refuse_wrong_columns_naming_file_and_columns(tmp_path, name, text, words):
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    path.write_text(text)
    task = {"SST-2": "sst2", "CoLA": "cola", "MNLI": "mnli", "RTE": "rte"}[path.parent.name]
    with pytest.raises(UserError) as error:
        glue_tasks.read_glue_tsv(path, task)
    assert str(path) in str(error.value) and words in str(error.value)


# ---- fine-tuning a tiny BERT run ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, cache_dir) -> Path:
    """A 2-step run of recipes/bert_tiny.yaml: its tokenizer and an (almost untrained) masked-LM BERT."""
    root = tmp_path_factory.mktemp("tiny_bert")
    sets = ["train.steps=2", "train.log_every=1", "train.val_every=0", "train.val_batches=1", "logging.wandb=disabled", f"data.cache_dir={cache_dir}"]
    done = zoa("run", "recipes/bert_tiny.yaml", "--out", str(root / "run"), *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


def cue_rows(vocab: list[str], n: int, rng: random.Random) -> list[str]:
    """SST-2 rows: five random words and "good" (label 1) or "bad" (label 0) at a random place."""
    rows = []
    for i in range(n):
        words = rng.sample(vocab, 5)
        words.insert(rng.randrange(6), "good" if i % 2 else "bad")
        rows.append(f"{' '.join(words)}\t{i % 2}")
    rng.shuffle(rows)
    return rows


@pytest.fixture(scope="module")
def cue_task(tmp_path_factory, tiny_bert) -> Path:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert / "tokenizer")
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) > 2 and w not in ("good", "bad"))
    assert {"good", "bad"} <= set(tokenizer.get_vocab()) and len(vocab) > 1000
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("cue")
    (root / "SST-2").mkdir()
    (root / "SST-2" / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(cue_rows(vocab, 160, rng)) + "\n")
    (root / "SST-2" / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(cue_rows(vocab, 63, rng)) + "\n")  # odd: ranks' slices differ
    return root


@pytest.mark.slow
def test_the_encoder_comes_from_the_checkpoint(tiny_bert):
    from zoa_train.evaluation.checkpoints import load_language_model

    loaded = load_language_model(tiny_bert, "glue")
    state = glue.encoder_weights(tiny_bert, loaded)
    assert not any(k.startswith("pooler.") for k in state)  # a masked-LM model: no pooler
    torch.manual_seed(0)
    model = glue.classification_model(loaded.model.config, state, 3)
    assert model.num_labels == 3 and model.classifier.out_features == 3
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, loaded.model.bert.embeddings.word_embeddings.weight)
    assert torch.equal(model.bert.encoder.layer[1].output.dense.weight, loaded.model.bert.encoder.layer[1].output.dense.weight)


@pytest.mark.slow
def test_glue_learns_a_word_cue_from_a_tiny_checkpoint(tiny_bert, cue_task, tmp_path):
    out = tmp_path / "glue.json"
    done = zoa("eval", "glue", "--checkpoint", str(tiny_bert), "--task", "sst2", "--data-dir", str(cue_task), *FAST, "--seeds", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    sst2 = result["tasks"]["sst2"]
    assert sst2["metrics"]["accuracy"] >= 0.9, result
    assert [run["seed"] for run in sst2["per_seed"]] == [0, 1] and result["seeds"] == [0, 1]
    assert sst2["metrics"]["accuracy"] == pytest.approx(np.median([run["accuracy"] for run in sst2["per_seed"]]))
    assert sst2["dev_examples"] == {"dev": 63} and sst2["train_examples"] == 160
    assert result["protocol"].startswith("glue dev, fine-tuned 4 epochs") and "median of 2 seeds" in result["protocol"]
    assert result["finetune"] == {
        "lr": 1e-3,
        "epochs": 4,
        "batch_size": 16,
        "seq_len": 16,
        "warmup_ratio": 0.1,
        "weight_decay": 0.01,
        "grad_clip": 1.0,
        "seed": 0,
    }
    assert result["checkpoint"]["step"] == 2 and result["checkpoint"]["source"].endswith("step_00000002/model.pt")
    assert result["pooler"] == "fresh" and "no pooler" in done.stderr
    assert "SST-2" in done.stdout and "accuracy" in done.stdout


@pytest.mark.slow
def test_all_tasks_end_to_end_with_the_glue_average(tiny_bert, glue_dir):
    # every task's head (3 classes for MNLI, a regression for STS-B) and both MNLI dev files, in-process
    overrides = ["finetune.epochs=1", "finetune.batch_size=2", "finetune.seq_len=24"]
    result = glue.evaluate_glue(tiny_bert, "all", glue_dir, overrides, seeds=1)
    tasks = result["tasks"]
    assert list(tasks) == list(glue_tasks.TASKS)
    assert set(tasks["mnli"]["metrics"]) == {"accuracy", "accuracy_mm"} and tasks["mnli"]["dev_examples"] == {"dev": 2, "dev_mm": 2}
    assert set(tasks["stsb"]["metrics"]) == {"pearson", "spearmanr"} and set(tasks["cola"]["metrics"]) == {"matthews_correlation"}
    assert set(tasks["mrpc"]["metrics"]) == set(tasks["qqp"]["metrics"]) == {"accuracy", "f1"}
    assert tasks["qqp"]["skipped_rows"] == 1
    scores = {name: glue_tasks.task_score(name, t["metrics"]) for name, t in tasks.items()}
    finite = all(not np.isnan(v) for v in scores.values())
    assert (result["glue_average"] == pytest.approx(np.mean(list(scores.values())))) if finite else np.isnan(result["glue_average"])
    json.dumps(files.finite(result), allow_nan=False)  # an undefined correlation is written as null
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(glue.format_glue(result))
    table = console.export_text()
    assert "GLUE average" in table and "MNLI" in table


@pytest.mark.slow
def test_glue_under_torchrun_covers_the_whole_dev_set(tiny_bert, cue_task, tmp_path):
    out = tmp_path / "glue.json"
    done = zoa("eval", "glue", "--checkpoint", str(tiny_bert), "--task", "sst2", "--data-dir", str(cue_task), *FAST, "--json", str(out), command=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    # every one of the 63 dev examples is predicted once: a rank's missing slice would score as class 0
    assert result["tasks"]["sst2"]["metrics"]["accuracy"] >= 0.9, result
    assert done.stdout.count("SST-2") == 1  # rank 0 alone prints


# ---- bad input: one sentence, exit code 2 ---------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_bert) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(vocab_size=4096, n_positions=64, n_layer=1, n_embd=32, n_head=2, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tiny_bert / "tokenizer").save_pretrained(path)
    return path


@pytest.mark.slow
def test_bad_input_through_the_console_entry_point(tiny_bert, cue_task):
    done = zoa("eval", "glue", "--checkpoint", str(tiny_bert), "--task", "sst2", "--data-dir", str(cue_task / "nowhere"))
    refused(done, "does not exist")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["missing file", "wrong columns", "gpt2 checkpoint", "unknown task", "unknown setting", "missing checkpoint"],
)
def test_bad_input(case, tiny_bert, cue_task, gpt2_dir, tmp_path, capsys):
    checkpoint, task, data, extra, words = tiny_bert, "sst2", cue_task, [], []
    if case == "missing file":
        write_glue(tmp_path, {"SST-2/train.tsv": FIXTURES["SST-2/train.tsv"]})
        data, words = tmp_path, [str(tmp_path / "SST-2" / "dev.tsv"), "does not exist"]
    elif case == "wrong columns":
        write_glue(tmp_path, {"SST-2/train.tsv": FIXTURES["SST-2/train.tsv"], "SST-2/dev.tsv": "text\tlabel\nfine\t1\n"})
        data, words = tmp_path, [str(tmp_path / "SST-2" / "dev.tsv"), "sentence, label"]
    elif case == "gpt2 checkpoint":
        checkpoint, words = gpt2_dir, ["GPT-2", "needs a BERT model"]
    elif case == "unknown task":
        task, words = "squad", ["--task must be one of cola, sst2", "'squad'"]
    elif case == "unknown setting":
        extra, words = ["--set", "finetune.learning_rate=1e-4"], ["unknown key finetune.learning_rate"]
    elif case == "missing checkpoint":
        checkpoint, words = tmp_path / "no_run", ["no such file or directory"]
    done = zoa_here(capsys, "eval", "glue", "--checkpoint", str(checkpoint), "--task", task, "--data-dir", str(data), *extra)
    refused(done, *words)
