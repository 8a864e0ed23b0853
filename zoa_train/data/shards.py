"""Token cache: each split tokenized once into one flat, memory-mapped token file.

Training then slices blocks out of that file at no tokenization cost, and every rank (and every
later run) maps the same file instead of holding its own copy. The file name is a hash of what
determines its content: the source (with file sizes and mtimes), the split and the tokenizer, so
a changed input gets a new file rather than a stale one.

Layout under ``cache_dir``: ``tokens-<key>.bin`` (token ids, uint16 when the vocabulary fits, else
uint32; each document followed by one separator token: EOS for GPT-2, [SEP] for BERT) and
``tokens-<key>.json`` (dtype, counts, written last, so its presence means the .bin is complete).
"""

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from zoa_train.data.cache import atomic_write_text, exclusive_lock, temporary_name
from zoa_train.data.sources import TextSource, iter_texts, source_fingerprint
from zoa_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENCODE_BATCH = 2048  # documents per encode_batch call: enough to keep the Rust threads busy


def load_or_build_tokens(source: TextSource, split: str, tokenizer: "PreTrainedTokenizerBase", cache_dir: str | Path) -> np.memmap:
    """The token ids of ``split`` as a read-only memmap, tokenizing only if the cache lacks them.

    Safe to call from all ranks at once: one builds under an exclusive lock, the others wait on it
    and then map the finished file.
    """
    cache_dir = Path(cache_dir)
    backend = _backend(tokenizer)
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if separator is None:
        raise UserError("The tokenizer has neither an EOS nor a SEP token to separate documents.")
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, source_fingerprint(source), split, backend.to_str(), separator]).encode()).hexdigest()[:20]
    bin_path, meta_path = cache_dir / f"tokens-{key}.bin", cache_dir / f"tokens-{key}.json"
    if not meta_path.exists():
        with exclusive_lock(cache_dir / f"tokens-{key}.lock"):
            if not meta_path.exists():
                dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
                texts = iter_texts(source, split, cache_dir / "datasets")
                meta = _build(texts, backend, separator, dtype, bin_path)
                meta |= {"source": source.name, "split": split, "tokenizer": tokenizer.name_or_path}
                atomic_write_text(meta_path, json.dumps(meta, indent=1))
    meta = json.loads(meta_path.read_text())
    return np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))


def _backend(tokenizer: "PreTrainedTokenizerBase") -> Tokenizer:
    """A private copy of the Rust tokenizer with truncation and padding off, so every document is encoded whole."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"Tokenizer {tokenizer.name_or_path} has no fast (Rust) version; use one with a tokenizer.json.")
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def _build(texts: Iterable[str], backend: Tokenizer, separator: int, dtype: type, bin_path: Path) -> dict:
    """Stream ``texts`` through the tokenizer into ``bin_path``, renamed into place only when complete."""
    started = time.perf_counter()
    tmp = temporary_name(bin_path)
    num_docs = num_tokens = 0
    try:
        with open(tmp, "wb") as f:
            for batch in _batched(texts, ENCODE_BATCH):
                ids = _encode(backend, batch, separator, dtype)
                f.write(ids.tobytes())
                num_docs += len(batch)
                num_tokens += len(ids)
            f.flush()
            os.fsync(f.fileno())
        if num_tokens == 0:
            raise UserError("The data source has no text in this split.")
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    log.info("Tokenized %d documents into %d tokens in %.1fs -> %s", num_docs, num_tokens, seconds, bin_path)
    return {"dtype": np.dtype(dtype).name, "num_tokens": num_tokens, "num_documents": num_docs, "seconds": round(seconds, 2)}


def _encode(backend: Tokenizer, texts: list[str], separator: int, dtype: type) -> np.ndarray:
    """One flat array: each document's ids followed by the separator (no per-token Python work)."""
    docs = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    total = sum(map(len, docs)) + len(docs)
    stream = itertools.chain.from_iterable(itertools.chain(ids, (separator,)) for ids in docs)
    return np.fromiter(stream, dtype=dtype, count=total)


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
