"""Megatron-LM's indexed token files, PREFIX.bin and PREFIX.idx: read by memory map, and written by
zoa-train's own token cache (zoa_train/data/shards.py), so that one reader serves both.

The format, version 1, as megatron-core's IndexedDatasetBuilder and Megatron's preprocess_data.py write
it: PREFIX.bin holds the token ids of every sequence end to end, in one integer type. PREFIX.idx holds,
little-endian, the 9 bytes ``MMIDIDX\\0\\0``, the version (u64), the type's code (u8), the number of
sequences S (u64) and of document indices D + 1 (u64); then each sequence's length in tokens (int32 x S),
its byte offset into .bin (int64 x S), and the sequence index at which each document starts, 0 first and
S last (int64 x D + 1). Multimodal files add a mode per sequence (int8 x S), which is not read here. A
document is one sequence (preprocess_data.py's default) or several (one per sentence, --split-sentences).
"""

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoa_train.data.cache import temporary_name
from zoa_train.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, type code, sequences, document indices: 34 bytes
# Megatron's codes of the token types (its DType enum); 6 and 7 are floats, which are no token ids.
TYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
CODES = {name: code for code, name in TYPES.items()}


@dataclass(frozen=True)
class IndexedTokens:
    """One prefix, mapped: every token id end to end, and where its sequences and documents start."""

    prefix: str
    tokens: np.memmap  # all token ids of PREFIX.bin, in the file's type
    sequence_lengths: np.ndarray  # int32, one per sequence (a memory map of the index)
    document_indices: np.ndarray  # int64, D + 1: the sequence at which each document starts, then S (a memory map)
    document_offsets: np.ndarray  # int64, D + 1: the token at which each document starts, then the number of tokens

    @property
    def num_documents(self) -> int:
        return len(self.document_offsets) - 1

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.document_offsets[i] : self.document_offsets[i + 1]]


def read_indexed(prefix: str | Path, key: str) -> IndexedTokens:
    """Map PREFIX.bin and PREFIX.idx after checking that they agree; UserError of one sentence naming the
    file and what is wrong with it otherwise. `key` names where the prefix came from (data.prefixes)."""
    prefix = str(Path(prefix).expanduser())
    idx_path, bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise UserError(f"{key} names {prefix}, and {path} does not exist; a prefix is the path of a Megatron .bin and .idx pair without the suffix.")
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(_HEAD.size)
    if not (head.startswith(MAGIC) or MAGIC.startswith(head)):
        raise UserError(
            f"{idx_path} is not a Megatron index (it does not start with MMIDIDX); give the .idx that preprocess_data.py or IndexedDatasetBuilder wrote."
        )
    if len(head) < _HEAD.size:
        raise UserError(f"{idx_path} is truncated: it holds {size} bytes, fewer than the {_HEAD.size} of its header; write the prefix again.")
    _, version, code, sequences, indices = _HEAD.unpack(head)
    if version != VERSION:
        raise UserError(
            f"{idx_path} is an index of version {version}, and zoa-train reads version {VERSION}, Megatron's MMIDIDX format; write it again with megatron-core."
        )
    if code not in TYPES:
        raise UserError(f"{idx_path} gives the token type code {code}, which is none of Megatron's (1 to 8); it is damaged or of another format.")
    if TYPES[code].startswith("float"):
        raise UserError(f"{idx_path} stores {TYPES[code]} values, not token ids; a prefix of a language corpus holds integer token ids.")
    expected = _HEAD.size + sequences * 12 + indices * 8
    if size < expected:
        raise UserError(
            f"{idx_path} is truncated: its header counts {sequences:,} sequences and {indices:,} document indices, "
            f"which take {expected:,} bytes, and it holds {size:,}; write the prefix again."
        )
    if size not in (expected, expected + sequences):  # the second: one mode per sequence (multimodal)
        raise UserError(f"{idx_path} holds {size - expected:,} bytes more than its header counts; it is damaged or of another format.")
    if indices < 1:
        raise UserError(f"{idx_path} is damaged: it counts no document indices, where the first is always 0; write the prefix again.")
    if sequences == 0:
        raise UserError(f"{key} names {prefix}, which holds no tokens (no sequences); leave it out or write it again.")
    lengths = np.memmap(idx_path, np.int32, "r", offset=_HEAD.size, shape=(sequences,))
    pointers = np.memmap(idx_path, np.int64, "r", offset=_HEAD.size + sequences * 4, shape=(sequences,))
    starts = np.memmap(idx_path, np.int64, "r", offset=_HEAD.size + sequences * 12, shape=(indices,))
    if starts[0] != 0 or starts[-1] != sequences or np.any(np.diff(starts) < 0):
        raise UserError(f"{idx_path} is damaged: its document indices do not run from 0 up to its {sequences:,} sequences; write the prefix again.")
    dtype = np.dtype(TYPES[code])
    offsets = np.empty(sequences + 1, dtype=np.int64)  # each sequence's first token, then the number of tokens
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    if np.any(lengths < 0) or not np.array_equal(pointers, offsets[:-1] * dtype.itemsize):
        raise UserError(f"{idx_path} does not place its sequences end to end in {bin_path.name}; zoa-train reads files as IndexedDatasetBuilder writes them.")
    count = int(offsets[-1])
    if count == 0:
        raise UserError(f"{key} names {prefix}, which holds no tokens ({indices - 1:,} empty documents); leave it out or write it again.")
    if bin_path.stat().st_size < count * dtype.itemsize:
        raise UserError(
            f"{bin_path} is truncated: its index counts {count:,} tokens of {dtype.itemsize} bytes and it holds {bin_path.stat().st_size:,} bytes; write the prefix again."
        )
    tokens = np.memmap(bin_path, dtype, "r", shape=(count,))
    return IndexedTokens(prefix, tokens, lengths, starts, offsets[starts])


def write_indexed(prefix: str | Path, tokens: np.ndarray, lengths: np.ndarray) -> None:
    """Write `tokens` as PREFIX.bin and PREFIX.idx, one sequence and one document per entry of `lengths`.
    Each file is written under a temporary name and renamed into place, the index last: where PREFIX.idx
    exists, PREFIX.bin is complete."""
    prefix = str(prefix)
    tokens = np.ascontiguousarray(tokens)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=pointers[1:])
    pointers *= tokens.dtype.itemsize
    head = _HEAD.pack(MAGIC, VERSION, CODES[tokens.dtype.name], len(lengths), len(lengths) + 1)
    body = (lengths, pointers, np.arange(len(lengths) + 1, dtype=np.int64))
    _write_atomically(Path(prefix + ".bin"), [tokens.tobytes()])
    _write_atomically(Path(prefix + ".idx"), [head, *(part.tobytes() for part in body)])


def _write_atomically(path: Path, parts: list[bytes]) -> None:
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
