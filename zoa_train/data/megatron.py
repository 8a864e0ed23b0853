"""data.source megatron: Megatron-LM's indexed datasets (zoa_train/data/indexed.py) as the training and
validation token streams.

``data.prefixes`` name .bin/.idx pairs; ``data.weights`` blends them as Megatron's ``--data-path 0.3 A 0.7 B``
does; ``data.validation_prefixes`` are the validation set, or without them the last 5% of each training
prefix's documents (at least one) are held out, the rest trains. Every document is followed by the
tokenizer's separator (EOS for GPT-2, [SEP] for BERT), as in zoa-train's own token cache: where a document
ends with it already (preprocess_data.py --append-eod) nothing is added, elsewhere the stream adds it
(token_stream.py), so the blocks of zoa_train/data/lm.py see document ends as they always have.

A blend is one epoch of as many tokens as its prefixes hold together, each prefix's share its weight: a
prefix whose share is larger than itself repeats (all its documents before any twice), one whose share is
smaller gives its first documents; documents are interleaved so that every stretch of the stream holds the
prefixes in their proportions. The model's vocabulary is the tokenizer's (``data.tokenizer``, required); a
token id beyond it is refused in one sentence (each file is scanned once; the range is kept in the cache).
"""

import hashlib
import json
from pathlib import Path

import numpy as np

from zoa_train.data.cache import atomic_write_text, exclusive_lock
from zoa_train.data.indexed import IndexedTokens, read_indexed
from zoa_train.data.sources import TextSource
from zoa_train.data.token_stream import Pieces, TokenStream, documents, stream
from zoa_train.errors import UserError

SOURCE = "megatron"
KEYS = ("prefixes", "weights", "validation_prefixes")
HELD_OUT = TextSource.validation_fraction  # of each training prefix's documents, without validation prefixes (as for text)
_SCAN = 2**26  # tokens read at a time when a file's range of ids is found


def check_recipe(d, origin: str) -> None:
    """The data section's rules for megatron prefixes, before any rank starts: the keys agree with each other,
    every prefix's files are there and readable, and a held-out tail leaves documents to train on."""
    if d.source != SOURCE:
        for key in KEYS:
            if getattr(d, key):
                raise UserError(
                    f"{origin}: data.{key} is read only with data.source megatron, not {d.source}; set data.source megatron or leave data.{key} unset."
                )
        return
    if not d.prefixes:
        raise UserError(f"{origin}: data.source megatron needs data.prefixes, the paths of Megatron .bin and .idx pairs without the suffix.")
    if d.train_files or d.validation_files:
        raise UserError(
            f"{origin}: data.source megatron reads data.prefixes and data.validation_prefixes, not data.train_files or data.validation_files; leave those unset."
        )
    if d.weights and len(d.weights) != len(d.prefixes):
        raise UserError(
            f"{origin}: data.weights gives {len(d.weights)} weights for the {len(d.prefixes)} prefix{'es' if len(d.prefixes) > 1 else ''} of data.prefixes; "
            "give one weight per prefix, or none to take every prefix whole."
        )
    if getattr(d, "streaming", False):
        raise UserError(f"{origin}: data.source megatron is read by memory map, already tokenized, so it is not streamed; set data.streaming false.")
    if not d.tokenizer:
        raise UserError(
            f"{origin}: data.source megatron needs data.tokenizer, the tokenizer the prefixes were made with (a hub name or a directory), "
            "which gives the vocabulary and the document separator."
        )
    try:
        train = [read_indexed(p, "data.prefixes") for p in d.prefixes]
        for p in d.validation_prefixes:
            read_indexed(p, "data.validation_prefixes")
    except UserError as e:
        raise UserError(f"{origin}: {e}") from None
    if not d.validation_prefixes:
        for indexed in train:
            if indexed.num_documents < 2:
                raise UserError(
                    f"{origin}: data.prefixes names {indexed.prefix}, which holds {indexed.num_documents} document, too few to hold "
                    f"{HELD_OUT:.0%} of them out for validation; give data.validation_prefixes."
                )


def megatron_streams(prefixes: list[str], weights: list[float], validation_prefixes: list[str], separator: int) -> tuple:
    """The training and validation token streams (np.memmap or TokenStream) of the prefixes, and every file read."""
    train = [read_indexed(p, "data.prefixes") for p in prefixes]
    if validation_prefixes:
        validation = [read_indexed(p, "data.validation_prefixes") for p in validation_prefixes]
        train_parts = [documents(t, i, 0, t.num_documents, separator) for i, t in enumerate(train)]
        validation_parts = [documents(v, i, 0, v.num_documents, separator) for i, v in enumerate(validation)]
        validation_stream = _joined([v.tokens for v in validation], validation_parts, [], separator)
    else:
        cuts = [t.num_documents - max(1, round(t.num_documents * HELD_OUT)) for t in train]
        train_parts = [documents(t, i, 0, cut, separator) for i, (t, cut) in enumerate(zip(train, cuts))]
        validation_parts = [documents(t, i, cut, t.num_documents, separator) for i, (t, cut) in enumerate(zip(train, cuts))]
        validation_stream = _joined([t.tokens for t in train], validation_parts, weights, separator)
        validation = []
    return _joined([t.tokens for t in train], train_parts, weights, separator), validation_stream, train + validation


def _joined(arrays: list[np.ndarray], parts: list[Pieces], weights: list[float], separator: int) -> "np.ndarray | TokenStream":
    """The parts one after another, or blended by ``weights``."""
    return stream(arrays, blend(parts, weights) if weights else Pieces.joined(parts), separator)


def blend(parts: list[Pieces], weights: list[float]) -> Pieces:
    """Documents of each part (one piece each), as many tokens in all as the parts hold and part i's share
    weights[i] / sum(weights) of them, interleaved by how far each part is through its share.

    Part i gives its documents in order, all of them as often as its share holds it whole, then its first
    documents up to the rest of its share (the last one taken whole, so a share may run over by less than a
    document); a piece's place in the stream is the midpoint of its tokens as a fraction of its part's share."""
    sizes = [p.length + p.separated for p in parts]
    total = sum(int(s.sum()) for s in sizes)
    shares = [round(total * w / sum(weights)) for w in weights]
    chosen, places = [], []
    for part, size, share in zip(parts, sizes, shares):
        whole = int(size.sum())
        rounds, rest = divmod(share, whole)
        ends = np.cumsum(size)
        order = np.concatenate([np.tile(np.arange(len(part)), rounds), np.arange(np.searchsorted(ends, rest) + 1 if rest else 0)])
        taken = part.take(order)
        through = np.cumsum(size[order]) - size[order] / 2
        chosen.append(taken)
        places.append(through / max(share, 1))
    order = np.argsort(np.concatenate(places), kind="stable")
    return Pieces.joined(chosen).take(order)


def check_token_ids(files: list[IndexedTokens], vocab_size: int, tokenizer: str, cache_dir: Path) -> None:
    """Refuse, in one sentence, a file holding a token id the model cannot embed (negative, or vocab_size or more)."""
    for indexed in files:
        dtype = indexed.tokens.dtype
        if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
            continue  # every id its type can hold is in the vocabulary
        low, high = id_range(indexed, cache_dir)
        if low < 0:
            raise UserError(f"{indexed.prefix}.bin holds the token id {low:,}, and token ids are 0 or more; write the prefix again.")
        if high >= vocab_size:
            raise UserError(
                f"{indexed.prefix}.bin holds the token id {high:,}, beyond the {vocab_size:,} tokens of data.tokenizer {tokenizer}; "
                "give the tokenizer the prefix was made with."
            )


def id_range(indexed: IndexedTokens, cache_dir: Path) -> tuple[int, int]:
    """The smallest and largest token id of a file: read once per file version (path, size, modification time),
    under a lock so that a node's ranks read it once, then kept in ``cache_dir``."""
    path = Path(indexed.prefix + ".bin").resolve()
    stat = path.stat()
    key = hashlib.sha256(json.dumps([str(path), stat.st_size, stat.st_mtime_ns]).encode()).hexdigest()[:20]
    record = Path(cache_dir) / f"token-ids-{key}.json"
    if not record.exists():
        with exclusive_lock(record.with_suffix(".lock")):
            if not record.exists():
                tokens = indexed.tokens
                chunks = [tokens[i : i + _SCAN] for i in range(0, len(tokens), _SCAN)]
                low, high = min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)
                atomic_write_text(record, json.dumps({"file": str(path), "low": low, "high": high}))
    found = json.loads(record.read_text())
    return found["low"], found["high"]
