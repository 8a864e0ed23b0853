"""Where the training text comes from: the bundled corpus, local files, or a hub dataset.

Every source is reduced to the same thing, a stream of documents (strings) for the ``train`` or
``validation`` split, so that tokenizers and the token cache never care where text came from.
Local files go through the ``datasets`` library's local builders, which work offline. Files and hub
datasets can also be opened as a stream (``open_stream``), read while training (data/streaming.py).
"""

import glob
import hashlib
import json
import lzma
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from zoa_train.errors import UserError

SPLITS = ("train", "validation")
BUNDLED_CORPUS = Path(__file__).parent / "corpus" / "austen.txt.xz"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_READ_BATCH = 1000


@dataclass(frozen=True)
class TextSource:
    """A recipe's data source.

    name: ``"bundled"`` (Jane Austen's novels shipped in the package), ``"files"`` (``train_files``
    and optionally ``validation_files``: .txt, .jsonl/.json or .parquet, globs allowed), or a hub
    dataset name such as ``"wikitext"`` with ``config`` such as ``"wikitext-103-raw-v1"``.
    When a source has no validation data of its own, the last ``validation_fraction`` of the train
    documents is held out, so the two splits never overlap.
    """

    name: str = "bundled"
    config: str | None = None
    train_files: tuple[str, ...] = ()
    validation_files: tuple[str, ...] = ()
    text_field: str = "text"
    txt_sample_by: str = "paragraph"  # .txt documents: "paragraph" (blank-line separated), "document" (whole file) or "line"
    validation_fraction: float = 0.05
    train_split: str = "train"  # hub split names
    validation_split: str = "validation"

    def __post_init__(self) -> None:
        if self.txt_sample_by not in ("paragraph", "document", "line"):
            raise UserError(f"txt_sample_by must be paragraph, document or line, not {self.txt_sample_by!r}.")
        if not 0 < self.validation_fraction < 1:
            raise UserError(f"validation_fraction must be between 0 and 1, not {self.validation_fraction}.")


def iter_texts(source: TextSource, split: str, cache_dir: str | Path | None = None) -> Iterator[str]:
    """Yield the non-blank documents of ``split`` (stripped), in the source's order.

    ``cache_dir`` is where ``datasets`` keeps its Arrow copies of files and hub downloads
    (its default cache when None).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if source.name == "bundled":
        texts = _held_out(bundled_paragraphs(), split, source.validation_fraction)
    else:
        dataset = _load_split(source, split, cache_dir)
        texts = (t for batch in dataset.iter(batch_size=_READ_BATCH) for t in batch[source.text_field])
    yield from documents(texts)


def documents(texts: Iterable[str | None]) -> Iterator[str]:
    """The documents among ``texts``: those not empty, missing or blank, stripped."""
    for text in texts:
        if text and not text.isspace():
            yield text.strip()


def bundled_paragraphs() -> list[str]:
    """All paragraphs of the bundled corpus, in order (see corpus/NOTICE.md)."""
    with lzma.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return f.read().rstrip("\n").split("\n\n")


def source_fingerprint(source: TextSource) -> str:
    """A hash that changes when the source's text may have changed, to key caches.

    Files are identified by path, size and modification time (cheap, no reading); the bundled corpus
    by its content; hub datasets by name and config only, since they are versioned upstream.
    """
    identity: dict = asdict(source)
    if source.name == "bundled":
        identity["content"] = hashlib.sha256(BUNDLED_CORPUS.read_bytes()).hexdigest()
    elif source.name == "files":
        identity["files"] = [
            [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in map(Path, _expand(source.train_files) + _expand(source.validation_files))
        ]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _held_out(docs, split: str, fraction: float):
    """The first (train) or last (validation) part of ``docs``: a tail split keeps neighbouring text together."""
    n_val = max(1, round(len(docs) * fraction))
    cut = len(docs) - n_val
    if isinstance(docs, list):
        return docs[:cut] if split == "train" else docs[cut:]
    return docs.select(range(cut) if split == "train" else range(cut, len(docs)))


def _load_split(source: TextSource, split: str, cache_dir):
    """One split as a ``datasets.Dataset``, from local files or the hub."""
    import datasets

    if source.name == "files":
        builder, data_files, options = _local_files(source)
        described = f"data files {', '.join(f for fs in data_files.values() for f in fs)}"
        try:
            splits = datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir, **options)
        except datasets.exceptions.DatasetGenerationError as e:
            raise UserError(f"Could not read {described}: {e.__cause__ or e}.") from e
        train_name, val_name = "train", "validation"
    else:
        described = f"hub dataset {source.name!r}" + (f" (config {source.config!r})" if source.config else "")
        try:
            splits = datasets.load_dataset(source.name, source.config, cache_dir=cache_dir)
        except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
            raise UserError(f"Could not load {described} ({e}); without internet use name 'bundled' or local files.") from e
        train_name, val_name = source.train_split, source.validation_split
        if train_name not in splits:
            raise UserError(f"The {described} has no split {train_name!r}; it has {sorted(splits)}.")

    dataset = splits[val_name] if split == "validation" and val_name in splits else splits[train_name]
    if source.text_field not in dataset.column_names:
        raise UserError(f"No field {source.text_field!r} in {described}; set text_field to one of {dataset.column_names}.")
    if val_name not in splits:
        dataset = _held_out(dataset, split, source.validation_fraction)
    return dataset


def _local_files(source: TextSource) -> tuple[str, dict[str, list[str]], dict]:
    """A files source as the ``datasets`` builder, its data_files by split and the builder's options."""
    data_files = {"train": _expand(source.train_files)}
    if source.validation_files:
        data_files["validation"] = _expand(source.validation_files)
    builder = _builder_for(data_files["train"] + data_files.get("validation", []))
    return builder, data_files, {"sample_by": source.txt_sample_by} if builder == "text" else {}


@dataclass
class Stream:
    """A split opened as a ``datasets`` IterableDataset of one column (``text_field``), in Arrow tables: one
    rank's part of it, and what to call it in a message."""

    dataset: object  # datasets.IterableDataset
    field: str
    described: str
    rank: int = 0
    world_size: int = 1


def open_stream(source: TextSource, split: str, rank: int = 0, world_size: int = 1) -> Stream:
    """``split`` of a files or hub source as a stream that is read while training, this rank's part of it.

    ``datasets.distributed.split_dataset_by_node`` gives each rank whole files (hub shards) where their
    number divides by ``world_size``, else every ``world_size``-th document (each rank then reads every
    file, but tokenizes only its own documents). Local files need no network; a hub dataset is read
    over it. A split without ``text_field`` is refused in one sentence.
    """
    import datasets
    from datasets.distributed import split_dataset_by_node

    if source.name == "files":
        builder, data_files, options = _local_files(source)
        if split not in data_files:
            raise UserError("A streamed files source reads its validation batches from validation_files; give at least one.")
        described = f"data files {', '.join(data_files[split])}"
        try:
            dataset = datasets.load_dataset(builder, data_files={split: data_files[split]}, split=split, streaming=True, **options)
        except (OSError, ValueError) as e:
            raise UserError(f"Could not read {described}: {e}.") from e
    else:
        name = source.train_split if split == "train" else source.validation_split
        described = f"hub dataset {source.name!r}" + (f" (config {source.config!r})" if source.config else "") + f", split {name!r}"
        try:
            dataset = datasets.load_dataset(source.name, source.config, split=name, streaming=True)
        except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
            raise UserError(f"Could not load {described} ({e}); without internet use local files.") from e
    try:
        fields = dataset.column_names or list(next(iter(dataset.take(1)), {}))  # the text builder's are known only once read
    except (OSError, ValueError) as e:  # ValueError: text that is not UTF-8, JSON or Parquet that is not (pyarrow.ArrowInvalid)
        raise UserError(f"Could not read {described}: {e}.") from e
    if source.text_field not in fields:
        raise UserError(
            f"data.text_field {source.text_field!r} is not a field of the streamed {described}, whose fields are {', '.join(fields) or 'none'}; "
            "set data.text_field to one of them."
        )
    dataset = split_dataset_by_node(dataset.select_columns([source.text_field]).with_format("arrow"), rank, world_size)
    return Stream(dataset, source.text_field, described, rank, world_size)


def _expand(patterns: tuple[str, ...]) -> list[str]:
    """Paths and glob patterns to a sorted list of existing files."""
    files = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise UserError(f"No data file matches {pattern}.")
            files += matches
        elif not Path(pattern).is_file():
            raise UserError(f"Data file {pattern} does not exist.")
        else:
            files.append(pattern)
    return files


def _builder_for(files: list[str]) -> str:
    """The ``datasets`` local builder for these files; one format per source."""
    if not files:
        raise UserError("A 'files' source needs at least one entry in train_files.")
    builders = set()
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in _BUILDERS:
            raise UserError(f"Data file {f} has an unsupported extension; use .txt, .jsonl, .json or .parquet.")
        builders.add(_BUILDERS[suffix])
    if len(builders) > 1:
        raise UserError(f"Data files {', '.join(files)} mix formats; use one format per source.")
    return builders.pop()
