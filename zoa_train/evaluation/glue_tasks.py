"""GLUE's nine tasks as `zoa-train eval glue` reads and scores them: the task table, the data files or
the hub dataset, and the metrics (the fine-tuning and the command are in glue.py).

Metrics carry the names of Hugging Face's run_glue.py and are computed with scikit-learn and scipy:
  cola  matthews_correlation              sst2, qnli, rte, wnli  accuracy
  mrpc, qqp  accuracy, f1 (of class 1)    stsb  pearson, spearmanr
  mnli  accuracy (dev_matched), accuracy_mm (dev_mismatched)
The GLUE average (`--task all`) is the GLUE leaderboard's: the unweighted mean over the nine tasks
of each task's main score, which for a task with two numbers is their mean: CoLA Matthews
correlation; SST-2, QNLI, RTE, WNLI accuracy; MRPC and QQP the mean of F1 and accuracy; STS-B the
mean of Pearson and Spearman; MNLI the mean of matched and mismatched accuracy (one task). It is
also given without WNLI, the average of BERT's paper tables. Task scores are taken from the
median metrics.

Data, `--data-dir DIR`: the original GLUE distribution (download_glue_data.py's layout), read as
UTF-8 (a leading byte-order mark, as MRPC's files have, is dropped) with tabs and no quote
processing (csv.QUOTE_NONE: a double quote is an ordinary character):
  CoLA/{train,dev}.tsv   no header: source, label, original label mark, sentence
  SST-2                  sentence, label
  MRPC                   Quality, #1 ID, #2 ID, #1 String, #2 String
  STS-B                  index, genre, filename, year, old_index, source1, source2, sentence1, sentence2, score (last)
  QQP                    id, qid1, qid2, question1, question2, is_duplicate
  MNLI/{train,dev_matched,dev_mismatched}.tsv   ... sentence1, sentence2, label1[, label2..label5], gold_label (last)
  QNLI                   index, question, sentence, label
  RTE                    index, sentence1, sentence2, label
  WNLI                   index, sentence1, sentence2, label
Text columns are found by their header names, the STS-B and MNLI labels in the last column.
Label ids are those of the Hugging Face `glue` dataset, so both data paths agree: CoLA, SST-2,
MRPC, QQP, WNLI the file's 0/1 (1: acceptable, positive, equivalent, duplicate, entailment);
MNLI entailment 0, neutral 1, contradiction 2; QNLI and RTE entailment 0, not_entailment 1; STS-B
the score as a float. A row with fewer fields than the header or an empty label is skipped and
counted (the original QQP train.tsv has a few); any other label is refused. `--data-dir hub`
loads the hub dataset nyu-mll/glue through `datasets` instead (online only).
"""

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from zoa_train.errors import UserError

HUB_DATASET = "nyu-mll/glue"


@dataclass(frozen=True)
class GlueTask:
    name: str  # the CLI's and the hub's name
    title: str  # as papers print it
    directory: str  # in the GLUE distribution
    text: tuple[str, ...]  # header names of the one or two text columns
    label: str  # header name of the label column
    expected: tuple[str, ...]  # the columns named in an error message
    labels: tuple[str, ...] | None = None  # text labels in id order; None: integers (a float for STS-B)
    num_labels: int = 2  # 1: regression
    header: bool = True
    label_last: bool = False  # the label is the last field of a row
    dev_files: tuple[tuple[str, str], ...] = (("", "dev.tsv"),)  # (metric suffix, file)
    hub_text: tuple[str, ...] = ("sentence1", "sentence2")
    hub_dev: tuple[tuple[str, str], ...] = (("", "validation"),)
    main: tuple[str, ...] = ("accuracy",)  # the metrics whose mean is the task's score


_ENTAILMENT = ("entailment", "not_entailment")
TASKS = {
    t.name: t
    for t in (
        GlueTask(
            "cola",
            "CoLA",
            "CoLA",
            ("sentence",),
            "label",
            ("source", "label", "original label mark", "sentence"),
            header=False,
            hub_text=("sentence",),
            main=("matthews_correlation",),
        ),
        GlueTask("sst2", "SST-2", "SST-2", ("sentence",), "label", ("sentence", "label"), hub_text=("sentence",)),
        GlueTask(
            "mrpc", "MRPC", "MRPC", ("#1 String", "#2 String"), "Quality", ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"), main=("f1", "accuracy")
        ),
        GlueTask(
            "stsb",
            "STS-B",
            "STS-B",
            ("sentence1", "sentence2"),
            "score",
            ("sentence1", "sentence2", "score"),
            num_labels=1,
            label_last=True,
            main=("pearson", "spearmanr"),
        ),
        GlueTask(
            "qqp",
            "QQP",
            "QQP",
            ("question1", "question2"),
            "is_duplicate",
            ("id", "qid1", "qid2", "question1", "question2", "is_duplicate"),
            hub_text=("question1", "question2"),
            main=("f1", "accuracy"),
        ),
        GlueTask(
            "mnli",
            "MNLI",
            "MNLI",
            ("sentence1", "sentence2"),
            "gold_label",
            ("sentence1", "sentence2", "gold_label"),
            labels=("entailment", "neutral", "contradiction"),
            num_labels=3,
            label_last=True,
            dev_files=(("", "dev_matched.tsv"), ("_mm", "dev_mismatched.tsv")),
            hub_text=("premise", "hypothesis"),
            hub_dev=(("", "validation_matched"), ("_mm", "validation_mismatched")),
            main=("accuracy", "accuracy_mm"),
        ),
        GlueTask(
            "qnli",
            "QNLI",
            "QNLI",
            ("question", "sentence"),
            "label",
            ("index", "question", "sentence", "label"),
            labels=_ENTAILMENT,
            hub_text=("question", "sentence"),
        ),
        GlueTask("rte", "RTE", "RTE", ("sentence1", "sentence2"), "label", ("index", "sentence1", "sentence2", "label"), labels=_ENTAILMENT),
        GlueTask("wnli", "WNLI", "WNLI", ("sentence1", "sentence2"), "label", ("index", "sentence1", "sentence2", "label")),
    )
}
_COLA_FIELDS = 4  # source, label, original label mark, sentence


# ---- data -----------------------------------------------------------------------------------------


@dataclass
class Split:
    source: str  # the file (or hub split) it came from
    text_a: list[str]
    text_b: list[str] | None
    labels: list  # ints, or floats for STS-B
    skipped: int = 0  # malformed rows left out

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class TaskData:
    train: Split
    dev: dict[str, Split]  # metric suffix ("" or "_mm") -> split


def task_names(task: str) -> list[str]:
    if task == "all":
        return list(TASKS)
    if task not in TASKS:
        raise UserError(f"--task must be one of {', '.join(TASKS)} or all, not {task!r}.")
    return [task]


def read_glue_tsv(path: str | Path, task: str | GlueTask) -> Split:
    """The examples of one GLUE distribution file of `task` (see the module docstring for the layouts)."""
    task = TASKS[task] if isinstance(task, str) else task
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path} does not exist; GLUE {task.title} needs {task.directory}/train.tsv and "
            f"{' and '.join(f'{task.directory}/{f}' for _, f in task.dev_files)} under --data-dir."
        )
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path} is not a readable tab-separated UTF-8 file: {e}.") from None
    text_a, text_b, labels, skipped = [], [] if len(task.text) == 2 else None, [], 0
    if task.header:
        if not rows:
            raise UserError(f"{path} is empty; expected GLUE {task.title}'s header with {_columns(task)}.")
        header = [name.strip() for name in rows[0]]
        body, first_line = rows[1:], 2
        missing = [name for name in (*task.text, task.label) if name not in header]
        if missing or (task.label_last and header[-1] != task.label):
            found = ", ".join(header[:12]) + (", ..." if len(header) > 12 else "")
            raise UserError(
                f"{path} does not have GLUE {task.title}'s columns: expected a tab-separated header with {_columns(task)}, found {found or 'an empty line'}."
            )
        text_at = [header.index(name) for name in task.text]
        label_at = len(header) - 1 if task.label_last else header.index(task.label)
        width = len(header)
    else:
        body, first_line = rows, 1
        if rows and (len(rows[0]) != _COLA_FIELDS or rows[0][1].strip() not in ("0", "1")):
            raise UserError(
                f"{path} does not have GLUE {task.title}'s columns: expected {_columns(task)}, found {len(rows[0])} field(s) starting {rows[0][:2]}."
            )
        text_at, label_at, width = [3], 1, _COLA_FIELDS
    for line, row in enumerate(body, first_line):
        raw = (row[-1] if task.label_last else row[label_at]).strip() if len(row) >= width else ""
        if not raw:  # a truncated row or an empty label
            skipped += 1
            continue
        labels.append(_label(raw, task, path, line))
        text_a.append(row[text_at[0]])
        if text_b is not None:
            text_b.append(row[text_at[1]])
    if not labels:
        raise UserError(f"{path} holds no GLUE {task.title} examples.")
    return Split(str(path), text_a, text_b, labels, skipped)


def _columns(task: GlueTask) -> str:
    names = ", ".join(task.expected)
    if not task.header:
        return f"{_COLA_FIELDS} tab-separated columns without a header ({names})"
    return names + (f" ({task.label} last)" if task.label_last else "")


def _label(raw: str, task: GlueTask, path: Path, line: int):
    if task.num_labels == 1:
        try:
            return float(raw)
        except ValueError:
            raise UserError(f"{path} line {line}: the {task.title} score must be a number, not {raw!r}.") from None
    if task.labels is not None:
        if raw not in task.labels:
            raise UserError(f"{path} line {line}: the {task.title} label must be one of {', '.join(task.labels)}, not {raw!r}.")
        return task.labels.index(raw)
    if raw not in [str(i) for i in range(task.num_labels)]:
        raise UserError(f"{path} line {line}: the {task.title} label must be 0 or 1, not {raw!r}.")
    return int(raw)


def load_task_data(data_dir: str | Path, task: str) -> TaskData:
    """Train and dev splits of `task` from a GLUE distribution directory, or from the hub when data_dir is "hub"."""
    spec = TASKS[task]
    if str(data_dir) == "hub":
        return TaskData(_hub_split(spec, "train"), {suffix: _hub_split(spec, split) for suffix, split in spec.hub_dev})
    root = Path(data_dir)
    if not root.is_dir():
        raise UserError(f"--data-dir {root} does not exist; give the directory of the GLUE distribution (CoLA/, SST-2/, MRPC/, ...) or hub.")
    folder = root / spec.directory
    return TaskData(read_glue_tsv(folder / "train.tsv", spec), {suffix: read_glue_tsv(folder / name, spec) for suffix, name in spec.dev_files})


def _hub_split(task: GlueTask, split: str) -> Split:
    """A split of the hub's GLUE dataset: its label ids are the ones this module pins for the files."""
    import datasets

    try:
        ds = datasets.load_dataset(HUB_DATASET, task.name, split=split)
    except Exception as e:  # noqa: BLE001 -- offline, a missing config, a hub error: all mean no data
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the hub dataset {HUB_DATASET} ({task.name}, {split}) could not be loaded: {first}") from None
    text_b = list(ds[task.hub_text[1]]) if len(task.hub_text) == 2 else None
    labels = [float(v) for v in ds["label"]] if task.num_labels == 1 else [int(v) for v in ds["label"]]
    return Split(f"{HUB_DATASET}/{task.name}/{split}", list(ds[task.hub_text[0]]), text_b, labels)


# ---- metrics --------------------------------------------------------------------------------------


def glue_metrics(task: str, predictions, labels, suffix: str = "") -> dict[str, float]:
    """run_glue.py's metrics of one dev split: predicted class ids (or scores for STS-B) against the labels."""
    import numpy as np

    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if task == "stsb":
        import warnings

        from scipy.stats import pearsonr, spearmanr

        if len(labels) < 2:  # a correlation needs two examples
            result = {"pearson": math.nan, "spearmanr": math.nan}
        else:
            with warnings.catch_warnings():  # constant predictions: the correlation is undefined (nan)
                warnings.simplefilter("ignore")
                result = {"pearson": float(pearsonr(predictions, labels)[0]), "spearmanr": float(spearmanr(predictions, labels)[0])}
    else:
        from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

        if task == "cola":
            result = {"matthews_correlation": float(matthews_corrcoef(labels, predictions))}
        else:
            result = {"accuracy": float(accuracy_score(labels, predictions))}
            if task in ("mrpc", "qqp"):
                result["f1"] = float(f1_score(labels, predictions, zero_division=0.0))
    return {name + suffix: value for name, value in result.items()}


def task_score(task: str, metrics: dict[str, float]) -> float:
    """A task's one number in the GLUE average: the mean of its main metrics."""
    return sum(metrics[name] for name in TASKS[task].main) / len(TASKS[task].main)


def glue_average(scores: dict[str, float], without: tuple[str, ...] = ()) -> float:
    values = [score for name, score in scores.items() if name not in without]
    return sum(values) / len(values)


def median_metrics(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's median over the runs (nan, an undefined correlation, counts as missing)."""
    result = {}
    for name in runs[0]:
        values = [r[name] for r in runs if not math.isnan(r[name])]
        result[name] = statistics.median(values) if values else math.nan
    return result
