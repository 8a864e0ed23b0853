"""One flat token stream over pieces of memory-mapped token files: what the language-model blocks cut into samples.

CausalLMBlocks, MaskedLMBlocks and SentencePairBlocks (zoa_train/data/lm.py) index a 1-D array of token ids in
which every document is followed by a separator (EOS for GPT-2, [SEP] for BERT). A TokenStream is that array
over several files (the token cache's shards, Megatron prefixes, a weighted blend of them) without copying a
token: a piece is a range of one file's tokens, followed by the separator where the document in it does not
end with one already. Reading a batch is one binary search over the pieces and one fancy index per file.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zoa_train.data.indexed import IndexedTokens


@dataclass
class Pieces:
    """Ranges of token files: piece i is tokens start[i] : start[i] + length[i] of file source[i], then the
    separator where separated[i]."""

    source: np.ndarray  # int32
    start: np.ndarray  # int64
    length: np.ndarray  # int64
    separated: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.start)

    def tokens(self) -> int:
        """The stream's length: tokens and the separators added."""
        return int(self.length.sum() + self.separated.sum())

    def take(self, order: np.ndarray) -> "Pieces":
        return Pieces(self.source[order], self.start[order], self.length[order], self.separated[order])

    @classmethod
    def joined(cls, parts: Sequence["Pieces"]) -> "Pieces":
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("source", "start", "length", "separated")))

    def merged(self) -> "Pieces":
        """Neighbours that continue each other in one file, with no separator between them, as one piece."""
        if len(self) < 2:
            return self
        follows = (self.source[1:] == self.source[:-1]) & (self.start[1:] == self.start[:-1] + self.length[:-1]) & ~self.separated[:-1]
        first = np.flatnonzero(np.concatenate([[True], ~follows]))
        last = np.append(first[1:], len(self)) - 1
        return Pieces(self.source[first], self.start[first], np.add.reduceat(self.length, first), self.separated[last])


def documents(indexed: IndexedTokens, source: int, first: int, stop: int, separator: int) -> Pieces:
    """Documents first .. stop - 1 of `indexed`, one piece each (empty ones left out), flagged for a separator
    where the document's last token is not `separator` already."""
    starts, ends = indexed.document_offsets[first:stop], indexed.document_offsets[first + 1 : stop + 1]
    kept = ends > starts
    starts, ends = starts[kept], ends[kept]
    separated = indexed.tokens[ends - 1] != separator
    return Pieces(np.full(len(starts), source, dtype=np.int32), starts.astype(np.int64), (ends - starts).astype(np.int64), separated)


class TokenStream:
    """The pieces' tokens, one after another, as a read-only 1-D array that can be indexed by integer arrays
    of any shape (the blocks' (rows, seq_len) windows) or by a slice."""

    def __init__(self, arrays: Sequence[np.ndarray], pieces: Pieces, separator: int):
        self.arrays, self.pieces, self.separator = list(arrays), pieces, separator
        self.dtype = np.result_type(*(a.dtype for a in self.arrays))
        self.ends = np.cumsum(pieces.length + pieces.separated)  # where each piece ends in the stream
        self.begins = self.ends - pieces.length - pieces.separated

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        positions = np.asarray(index, dtype=np.int64)
        flat = positions.ravel()
        if flat.size and (flat.min() < -len(self) or flat.max() >= len(self)):
            raise IndexError(f"index out of range for a token stream of {len(self)} tokens")
        flat = np.where(flat < 0, flat + len(self), flat)
        piece = np.searchsorted(self.ends, flat, side="right")
        offset = flat - self.begins[piece]
        out = np.full(flat.shape, self.separator, dtype=self.dtype)
        inside = offset < self.pieces.length[piece]
        sources = self.pieces.source[piece]
        for source in np.unique(sources[inside]):
            chosen = inside & (sources == source)
            out[chosen] = self.arrays[source][self.pieces.start[piece[chosen]] + offset[chosen]]
        return out.reshape(positions.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole stream in memory (for tests and small corpora)."""
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def stream(arrays: Sequence[np.ndarray], pieces: Pieces, separator: int) -> "np.ndarray | TokenStream":
    """The stream the pieces make: the file itself where it is one whole file with nothing added (no index
    to search), else a TokenStream."""
    pieces = pieces.merged()
    if len(pieces) == 1 and not pieces.separated[0] and pieces.start[0] == 0 and pieces.length[0] == len(arrays[pieces.source[0]]):
        return arrays[pieces.source[0]]
    return TokenStream(arrays, pieces, separator)
