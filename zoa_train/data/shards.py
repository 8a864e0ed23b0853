"""Token cache: each split tokenized once, by worker processes, into memory-mapped shard files in Megatron's
indexed format (zoa_train/data/indexed.py), the format that data.source megatron reads.

Training then slices blocks out of the shards at no tokenization cost, and every rank (and every later run)
maps the same files instead of holding its own copy. The files' name is a hash of what determines their
content: the source (with file sizes and mtimes), the split and the tokenizer, so a changed input gets new
files rather than stale ones.

Layout under ``cache_dir``, for a key K: ``tokens-K_00000.bin`` / ``.idx``, ``tokens-K_00001...``, each shard
a run of consecutive documents of at least SHARD_CHARS characters, each document one sequence of token ids
(uint16 when the vocabulary fits, else int32) followed by one separator token: EOS for GPT-2, [SEP] for BERT;
and ``tokens-K.json``, the manifest (type, shards, counts), written last: its presence means every shard is
complete. A shard appears under its name only once complete (index last), so a build that stops (killed,
interrupted, out of disk) keeps the shards it finished and the next one tokenizes only the others.

Worker processes tokenize shards side by side (the Rust tokenizer releases the GIL, but reading its output
into arrays does not). Ranks that share the cache directory build once: the first takes the lock, the others
wait and map the result. Where nodes do not share a disk, each node builds its own copy the same way.
"""

import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from zoa_train.data.cache import atomic_write_text, exclusive_lock
from zoa_train.data.indexed import read_indexed, write_indexed
from zoa_train.data.sources import TextSource, iter_texts, source_fingerprint
from zoa_train.data.token_stream import Pieces, TokenStream, stream
from zoa_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: one flat file per split; 2: Megatron-format shards
ENCODE_BATCH = 2048  # documents per encode_batch call: enough to keep the Rust threads busy
SHARD_CHARS = 2**23  # characters of text per shard (about 2M tokens): work for one worker at a time
PROGRESS_EVERY_S = 30.0  # a progress line this often where stderr is not a terminal


def load_or_build_tokens(
    source: TextSource, split: str, tokenizer: "PreTrainedTokenizerBase", cache_dir: str | Path, workers: int = 0
) -> "np.ndarray | TokenStream":
    """The token ids of ``split`` as one read-only stream (a memmap where there is one shard), tokenizing
    only what the cache lacks, with ``workers`` processes (0: one per CPU core this process may use).

    Safe to call from all ranks at once: one builds under an exclusive lock, the others wait on it and
    then map the finished files.
    """
    cache_dir = Path(cache_dir)
    backend = fast_backend(tokenizer)
    separator = document_separator(tokenizer)
    identity = [FORMAT_VERSION, SHARD_CHARS, source_fingerprint(source), split, backend.to_str(), separator]
    prefix = cache_dir / f"tokens-{hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]}"
    manifest_path = prefix.with_name(prefix.name + ".json")
    shards = _complete(manifest_path)
    if shards is None:
        with exclusive_lock(prefix.with_name(prefix.name + ".lock")):
            shards = _complete(manifest_path)
            if shards is None:
                dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32
                texts = iter_texts(source, split, cache_dir / "datasets")
                manifest = build_shards(texts, backend, separator, dtype, prefix, workers or available_cores(), f"{split} split of {source.name}")
                manifest |= {"source": source.name, "split": split, "tokenizer": tokenizer.name_or_path}
                atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
                shards = _complete(manifest_path)
    arrays = [shard.tokens for shard in shards]
    pieces = Pieces(
        np.arange(len(arrays), dtype=np.int32), np.zeros(len(arrays), np.int64), np.array([len(a) for a in arrays], np.int64), np.zeros(len(arrays), bool)
    )
    return stream(arrays, pieces, separator)


def document_separator(tokenizer: "PreTrainedTokenizerBase") -> int:
    """The token that follows every document in a stream: EOS (GPT-2), else [SEP] (BERT)."""
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if separator is None:
        raise UserError("The tokenizer has neither an EOS nor a SEP token to separate documents.")
    return separator


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shard_prefix(prefix: Path, index: int) -> Path:
    return prefix.with_name(f"{prefix.name}_{index:05d}")


def _complete(manifest_path: Path):
    """The shards a manifest lists, mapped, or None where there is no manifest or a shard is missing or damaged."""
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    try:
        return [read_indexed(manifest_path.parent / name, "the token cache") for name in manifest["shards"]]
    except UserError as e:
        log.warning("the token cache %s is incomplete (%s): building what it lacks", manifest_path, e)
        return None


def fast_backend(tokenizer: "PreTrainedTokenizerBase") -> Tokenizer:
    """A private copy of the Rust tokenizer with truncation and padding off, so every document is encoded whole."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"Tokenizer {tokenizer.name_or_path} has no fast (Rust) version; use one with a tokenizer.json.")
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def build_shards(texts: Iterable[str], backend: Tokenizer, separator: int, dtype: type, prefix: Path, workers: int, what: str) -> dict:
    """Tokenize ``texts`` into the shards of ``prefix`` that are not complete yet; the manifest's content.
    One process where one worker is asked for or the text fills one shard, else a pool of ``workers``."""
    started = time.perf_counter()
    _remove_abandoned(prefix)
    chunks = _chunks(texts, SHARD_CHARS)
    head = list(itertools.islice(chunks, 2))
    chunks = itertools.chain(head, chunks)
    counts: dict[int, tuple[int, int]] = {}  # shard -> (documents, tokens)
    progress = BuildProgress(what)
    try:
        if workers == 1 or len(head) < 2:
            for index, chunk in enumerate(chunks):
                existing = _existing(prefix, index)
                counts[index] = existing or _write_shard(backend, chunk, separator, dtype, shard_prefix(prefix, index))
                progress.advance(*counts[index], kept=existing is not None)
        else:
            _build_in_pool(chunks, backend, separator, dtype, prefix, workers, counts, progress)
    finally:
        progress.close()
    if not counts:
        raise UserError("The data source has no text in this split.")
    shards = [shard_prefix(prefix, i).name for i in range(len(counts))]
    num_docs, num_tokens = (sum(c[k] for c in counts.values()) for k in (0, 1))
    seconds = time.perf_counter() - started
    log.info("Tokenized %d documents into %d tokens in %.1fs -> %s (%d shards)", num_docs, num_tokens, seconds, prefix, len(shards))
    return {
        "format": "megatron",
        "dtype": np.dtype(dtype).name,
        "shards": shards,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "seconds": round(seconds, 2),
    }


def _remove_abandoned(prefix: Path) -> None:
    """Remove the temporary files of shards whose writer is gone: a process of this host that no longer runs
    (cache.temporary_name: .NAME.tmp-HOST-PID). Another host's are left alone: it may be writing them now."""
    host = socket.gethostname()
    for path in prefix.parent.glob(f".{prefix.name}_*.tmp-{host}-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _build_in_pool(chunks: Iterator[list[str]], backend, separator, dtype, prefix: Path, workers: int, counts: dict, progress: "BuildProgress") -> None:
    """The shards tokenized by ``workers`` processes, at most two chunks each in flight: a corpus larger than
    memory streams through. Forked where the platform can (no start-up: the workers import nothing); the
    workers' tokenizers run on one thread each."""
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with (
        _serial_tokenizers(),
        concurrent.futures.ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(backend.to_str(), separator, dtype)) as pool,
    ):
        pending: dict[concurrent.futures.Future, int] = {}
        try:
            for index, chunk in enumerate(chunks):
                existing = _existing(prefix, index)
                if existing:
                    counts[index] = existing
                    progress.advance(*existing, kept=True)
                    continue
                pending[pool.submit(_worker_shard, chunk, str(shard_prefix(prefix, index)))] = index
                while len(pending) >= 2 * workers:
                    _collect(pending, counts, progress, concurrent.futures.FIRST_COMPLETED)
            while pending:
                _collect(pending, counts, progress, concurrent.futures.ALL_COMPLETED)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _collect(pending: dict, counts: dict, progress: "BuildProgress", when: str) -> None:
    done, _ = concurrent.futures.wait(pending, return_when=when)
    for future in done:
        counts[pending.pop(future)] = future.result()
        progress.advance(*future.result())


@contextlib.contextmanager
def _serial_tokenizers() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false while workers are started: each worker is one core's work, and the Rust
    library then neither starts threads in them nor warns of the fork."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_WORKER: dict = {}


def _start_worker(tokenizer_json: str, separator: int, dtype: type) -> None:
    _WORKER.update(backend=Tokenizer.from_str(tokenizer_json), separator=separator, dtype=dtype)


def _worker_shard(texts: list[str], prefix: str) -> tuple[int, int]:
    return _write_shard(_WORKER["backend"], texts, _WORKER["separator"], _WORKER["dtype"], Path(prefix))


def _existing(prefix: Path, index: int) -> tuple[int, int] | None:
    """(documents, tokens) of shard ``index`` where an earlier build completed it, else None."""
    path = shard_prefix(prefix, index)
    if not path.with_name(path.name + ".idx").exists():
        return None
    try:
        shard = read_indexed(path, "the token cache")
    except UserError:
        return None
    return shard.num_documents, len(shard.tokens)


def _write_shard(backend: Tokenizer, texts: list[str], separator: int, dtype: type, prefix: Path) -> tuple[int, int]:
    """One shard's documents tokenized and written (zoa_train/data/indexed.py); (documents, tokens)."""
    lengths: list[np.ndarray] = []
    tokens = np.concatenate([encode_documents(backend, batch, separator, dtype, lengths) for batch in _batched(texts, ENCODE_BATCH)])
    write_indexed(prefix, tokens, np.concatenate(lengths))
    return len(texts), len(tokens)


def encode_documents(backend: Tokenizer, texts: list[str], separator: int, dtype: type, lengths: list | None = None) -> np.ndarray:
    """One flat array: each document's ids followed by the separator (no per-token Python work); each
    document's length with its separator appended to ``lengths`` (one array), where given."""
    docs = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    sizes = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs)) + 1
    if lengths is not None:
        lengths.append(sizes)
    stream = itertools.chain.from_iterable(itertools.chain(ids, (separator,)) for ids in docs)
    return np.fromiter(stream, dtype=dtype, count=int(sizes.sum()))


def _chunks(texts: Iterable[str], chars: int) -> Iterator[list[str]]:
    """Consecutive documents, at least ``chars`` characters a chunk (the last may be shorter)."""
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class BuildProgress:
    """Tokens and tokens/s of a build, from the process that builds: a rich line where stderr is a terminal,
    else a plain line every PROGRESS_EVERY_S seconds and one at the end."""

    def __init__(self, what: str):
        self.what, self.started, self.last = what, time.monotonic(), time.monotonic()
        self.shards = self.documents = self.tokens = self.kept = 0
        self._live = None
        if sys.stderr.isatty():
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            from zoa_train import console

            self._live = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console.err, transient=False)
            self._task = self._live.add_task(self._text())
            self._live.start()

    def _text(self) -> str:
        rate = (self.tokens - self.kept) / max(time.monotonic() - self.started, 1e-9)
        kept = f" ({self.kept:,} kept from an earlier build)" if self.kept else ""
        return f"tokenizing the {self.what}: {self.shards:,} shards, {self.documents:,} documents, {self.tokens:,} tokens{kept}, {rate:,.0f} tokens/s"

    def advance(self, documents: int, tokens: int, kept: bool = False) -> None:
        """One more shard of `documents` and `tokens`; `kept`: completed by an earlier build (not counted in the rate)."""
        self.shards, self.documents, self.tokens = self.shards + 1, self.documents + documents, self.tokens + tokens
        self.kept += tokens if kept else 0
        if self._live is not None:
            self._live.update(self._task, description=self._text())
        elif time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(self._text(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        elif self.shards > 1 or time.monotonic() - self.started >= PROGRESS_EVERY_S:
            print(self._text(), file=sys.stderr, flush=True)
