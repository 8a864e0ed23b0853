"""`eval wikitext`'s and `eval lambada`'s lm-eval-named metrics against lm-evaluation-harness itself.

A real gpt2_tiny run (2 steps) is exported with `zoa-train export`'s function; lm-eval scores the
directory with `--model hf` on task files this test writes (built like the harness's `wikitext` and
`lambada_openai` tasks, with the harness's own WikiText detokenizer and word and byte counts, on local
files read by datasets' `text` and `json` loaders), and zoa-train scores the same files. One
simple_evaluate call runs every task. Skipped only where the `dev` extra's `lm-eval[hf]` is missing.
"""

import json
import os
import re
import socket
from pathlib import Path

import pytest
from conftest import zoa

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[dev]' (the dev extra's lm-eval[hf])")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate: pip install -e '.[dev]' (the dev extra's lm-eval[hf])")

from zoa_train.data.sources import bundled_paragraphs  # noqa: E402
from zoa_train.evaluation.language import evaluate_lambada, evaluate_wikitext  # noqa: E402

pytestmark = pytest.mark.slow  # its fixtures train and export a run

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 16  # lm-eval's max_length and zoa-train's --seq-len: documents span several windows
BATCH = 4
REL = 1e-5

# Held-out paragraphs of the bundled corpus (the last ones: the training run's validation share).
PARAGRAPHS = [p for p in bundled_paragraphs()[-12:] if len(p.split()) > 20][:6]


def word_level(text: str) -> str:
    """WikiText's word-level form, roughly: punctuation, possessives and hyphens split off as in wiki.test.tokens."""
    text = re.sub(r"(\w)-(\w)", r"\1 @-@ \2", text)
    text = re.sub(r"'s\b", " 's", text)
    return re.sub(r"([,.;:!?])", r" \1", text)


# Three WikiText articles as lm-eval's document-level wikitext data holds them (its `page` field).
PAGES = [
    f" = {title} = \n \n {word_level(a)} \n {word_level(b)} \n \n = = Later = = \n \n {word_level(c)} \n \n"
    for title, (a, b, c) in zip(("Anne", "Wentworth", "Smith"), [PARAGRAPHS[i : i + 3] for i in (0, 2, 3)])
]
# Plain text: one paragraph per line with an empty line among them; paragraphs with a line break inside one.
LINES = "\n".join([*PARAGRAPHS[:3], "", *PARAGRAPHS[3:]]) + "\n"
PARAGRAPHS_TEXT = "\n\n".join([PARAGRAPHS[0], PARAGRAPHS[1] + "\n" + PARAGRAPHS[2], *PARAGRAPHS[3:]]) + "\n"

UTILS = '''"""The harness's own wikitext functions, on the field a task's documents are in."""
from lm_eval.tasks.wikitext import preprocess_wikitext as wikitext


def text(doc):
    return doc["text"]


def text_results(doc, results):
    return wikitext.process_results({"page": doc["text"]}, results)


detokenized_page = wikitext.wikitext_detokenizer
page_results = wikitext.process_results
'''

# (task, datasets loader, its keyword arguments, target, results, zoa-train's eval wikitext arguments)
ROLLING = {
    "headings": ("pages.jsonl", "json", {}, "detokenized_page", "page_results", {"data": "wiki.test.tokens"}),
    "jsonl_page": ("pages.jsonl", "json", {}, "detokenized_page", "page_results", {"data": "pages.jsonl", "documents": "jsonl", "text_field": "page"}),
    "lines": ("lines.txt", "text", {}, "text", "text_results", {"data": "lines.txt", "detokenize": False}),
    "paragraphs": (
        "paragraphs.txt",
        "text",
        {"sample_by": "paragraph"},
        "text",
        "text_results",
        {"data": "paragraphs.txt", "detokenize": False, "documents": "paragraphs"},
    ),
    "jsonl_text": ("lines.jsonl", "json", {}, "text", "text_results", {"data": "lines.jsonl", "detokenize": False, "documents": "jsonl"}),
}
LAMBADA = [p.rsplit(". ", 1)[-1].rstrip(".!?") for p in PARAGRAPHS] + [PARAGRAPHS[0].rstrip(".!?")]  # the last: a long context, cut


def rolling_task(name: str, data: Path, loader: str, kwargs: dict, target: str, results: str, cache: Path) -> str:
    """A task built like lm-eval's `wikitext` (loglikelihood_rolling, its three metrics) on a local file."""
    dataset_kwargs = {"data_files": {"test": str(data)}, "cache_dir": str(cache), **kwargs}
    return f"""task: zoa_{name}
dataset_path: {loader}
dataset_kwargs: {json.dumps(dataset_kwargs)}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function utils.{target}
process_results: !function utils.{results}
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def lambada_task(data: Path, cache: Path) -> str:
    """A task built like lm-eval's `lambada_openai` on a local JSON-lines file."""
    dataset_kwargs = {"data_files": {"test": str(data)}, "cache_dir": str(cache)}
    return f"""task: zoa_lambada
dataset_path: json
dataset_kwargs: {json.dumps(dataset_kwargs)}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def exported(tmp_path_factory, cache_dir, offline) -> Path:
    """A real gpt2_tiny run of 2 steps (one rank in the command's own process), exported as a Hugging Face directory."""
    from zoa_train.evaluation.export import export_language_model

    tmp = tmp_path_factory.mktemp("harness_model")
    sets = [
        "train.steps=2",
        "train.val_every=0",
        "train.val_batches=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
    ]
    one_rank = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp / "run"), *[a for s in sets for a in ("--set", s)], env=one_rank)
    assert done.returncode == 0, done.stderr[-3000:]
    export_language_model(tmp / "run", tmp / "hf")
    return tmp / "hf"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness_data")
    (root / "wiki.test.tokens").write_text("".join(PAGES), encoding="utf-8")
    (root / "pages.jsonl").write_text("".join(json.dumps({"page": p}) + "\n" for p in PAGES), encoding="utf-8")
    (root / "lines.txt").write_text(LINES, encoding="utf-8")
    (root / "paragraphs.txt").write_text(PARAGRAPHS_TEXT, encoding="utf-8")
    (root / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in LINES.split("\n")[:-1]), encoding="utf-8")
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def harness(exported, files, tmp_path_factory) -> dict:
    """lm-eval's results for every task, from one simple_evaluate call."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = tmp_path_factory.mktemp("harness_tasks")
    cache = tmp_path_factory.mktemp("harness_datasets")
    (tasks / "utils.py").write_text(UTILS)
    for name, (data, loader, kwargs, target, results, _) in ROLLING.items():
        (tasks / f"{name}.yaml").write_text(rolling_task(name, files / data, loader, kwargs, target, results, cache))
    (tasks / "lambada.yaml").write_text(lambada_task(files / "lambada.jsonl", cache))
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(exported), "max_length": SEQ_LEN, "dtype": "float32"},
        tasks=[f"zoa_{name}" for name in [*ROLLING, "lambada"]],
        batch_size=BATCH,
        device="cpu",
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )
    return out["results"]


def close(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= REL * abs(theirs)


@pytest.mark.parametrize("mode", list(ROLLING))
def test_wikitext_metrics_equal_the_harness(mode, exported, files, harness):
    arguments = dict(ROLLING[mode][5])
    data = str(files / arguments.pop("data"))
    ours = evaluate_wikitext(exported, data, SEQ_LEN, SEQ_LEN, BATCH, **arguments)
    theirs = harness[f"zoa_{mode}"]
    assert ours["lm_eval"]["documents"] == theirs["sample_len"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert close(ours["lm_eval"][metric], theirs[f"{metric},none"]), (mode, metric, ours["lm_eval"][metric], theirs[f"{metric},none"])


def test_other_documents_do_not_equal_the_harness(exported, files, harness):
    # The lines file as one document (the headings rule, on a text without headings): the check above can fail.
    whole = evaluate_wikitext(exported, str(files / "lines.txt"), SEQ_LEN, SEQ_LEN, BATCH, detokenize=False, documents="headings")["lm_eval"]
    theirs = harness["zoa_lines"]
    assert whole["documents"] == 1
    assert abs(whole["word_perplexity"] / theirs["word_perplexity,none"] - 1) > 0.01
    assert abs(whole["bits_per_byte"] / theirs["bits_per_byte,none"] - 1) > 1e-3


def test_lambada_metrics_equal_the_harness(exported, files, harness):
    ours = evaluate_lambada(exported, str(files / "lambada.jsonl"), BATCH, SEQ_LEN)
    theirs = harness["zoa_lambada"]
    assert ours["examples"] == theirs["sample_len"] == len(LAMBADA) and ours["contexts_cut"] >= 1
    assert close(ours["lm_eval_perplexity"], theirs["perplexity,none"]), (ours["lm_eval_perplexity"], theirs["perplexity,none"])
    assert ours["accuracy"] == theirs["acc,none"]
