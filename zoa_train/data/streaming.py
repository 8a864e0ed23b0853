"""Streaming (``data.streaming: true``): a corpus read while training, never tokenized whole beforehand.

Documents come from a ``datasets`` IterableDataset (local JSON lines, Parquet or text files, or a hub
dataset), in order. Each rank reads its own part of them (``sources.open_stream``: whole files or hub
shards per rank where their number divides by the world size, else every world_size-th document),
tokenizes them as they come, READ_BATCH documents per call of the Rust tokenizer, and packs the tokens
into blocks of the task's length, each document followed by its separator (EOS, or [SEP]) exactly as
the token cache writes them (shards.py). With ``data.shuffle_window`` N, each run of N consecutive
blocks of a rank is taken in an order drawn from (seed, rank, the window's number); 0 keeps the stream's.
At the end of the stream a rank starts it again, as ``datasets`` orders it for the next epoch.

The position is exact and small: where the current window's first block starts (the epoch, the
dataset's own ``state_dict`` before the read batch that holds that token, which ``datasets`` keeps
exact at batch boundaries, and the batch's tokens before it), the window's number, and how many of
its blocks were taken. A resume reads from there once more (one window and one read batch at most)
and stands where the run stood, however many times it is resumed. The tokenizer is named
(``data.tokenizer``): a stream is not read whole before training, so no tokenizer is trained on it.
"""

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from zoa_train.data.lm import Blocks, sample_keys
from zoa_train.data.shards import encode_documents, fast_backend
from zoa_train.data.sources import Stream, TextSource, documents, open_stream
from zoa_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

READ_BATCH = 64  # documents per read (one Arrow batch) and per encode_batch call: as fast as 1,024 on one thread, less to read again on resume
KIND = "datasets stream"  # marks a streamed position in a checkpoint (the token cache's has none)
_IDENTITY = ("rank", "world_size", "block_len", "shuffle_window", "seed")  # what a position means only together with


def check_streaming(recipe, origin: str) -> None:
    """Refuse, before any rank starts, a streamed recipe that cannot run: one sentence each."""
    d = recipe.data
    if d.source in ("bundled", "megatron"):  # small enough to tokenize whole; tokenized already and mapped
        raise UserError(
            f"{origin}: data.streaming reads data files or a hub dataset while training, not data.source {d.source}; set data.source files or a hub name."
        )
    if not d.tokenizer:
        raise UserError(
            f"{origin}: data.streaming needs data.tokenizer (a directory, e.g. a run's tokenizer/, or a hub name): "
            "a stream is read while training, never whole before it, so no tokenizer is trained on it."
        )
    if d.source == "files":
        if not d.validation_files:
            raise UserError(
                f"{origin}: data.streaming needs data.validation_files, which the validation batches are read from (a stream has no end to hold text out of)."
            )
        source = text_source(d)
        for split in ("train", "validation"):
            try:
                open_stream(source, split)  # the fields of local files are known without reading them whole
            except UserError as e:
                raise UserError(f"{origin}: {e}") from None


def text_source(d) -> TextSource:
    """The data section's source."""
    return TextSource(name=d.source, config=d.config, train_files=tuple(d.train_files), validation_files=tuple(d.validation_files), text_field=d.text_field)


@dataclass
class StreamedLM:
    """A streamed language-model corpus for one rank: its tokenizer, training batches and validation blocks."""

    tokenizer: "PreTrainedTokenizerBase"
    source: TextSource
    recipe: object
    rank: int
    world_size: int

    def batches(self, blocks_of: Callable[[np.ndarray], Blocks]) -> "StreamingBatchLoader":
        t = self.recipe.train
        stream = open_stream(self.source, "train", self.rank, self.world_size)
        encoder = DocumentEncoder(self.tokenizer)
        return StreamingBatchLoader(stream, encoder, blocks_of, t.micro_batch_size, self.rank, self.world_size, t.seed, self.recipe.data.shuffle_window)

    def validation(self, blocks_of: Callable[[np.ndarray], Blocks]) -> Blocks:
        """This rank's validation blocks: the head of its part of the validation stream, enough for train.val_batches micro-batches."""
        t = self.recipe.train
        length = block_length(blocks_of)
        wanted = t.val_batches * t.micro_batch_size * length
        stream = open_stream(self.source, "validation", self.rank, self.world_size)
        parts, have = [], 0
        for _, _, tokens in token_chunks(stream, DocumentEncoder(self.tokenizer), 0, None, endless=False):
            parts.append(tokens[: wanted - have])
            have += len(parts[-1])
            if have == wanted:
                break
        blocks = blocks_of(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        if len(blocks) < t.micro_batch_size:
            raise UserError(
                f"The part of the streamed {stream.described} read by rank {self.rank} of {self.world_size} holds {len(blocks)} blocks of "
                f"{length} tokens, fewer than a micro-batch of {t.micro_batch_size}; use more validation text or a smaller batch."
            )
        return blocks


def open_lm_stream(source: TextSource, kind: str, recipe, rank: int, world_size: int) -> StreamedLM:
    """The recipe's named tokenizer (``kind``: the family's, checked for the tokens it needs) and the source, to stream from."""
    from zoa_train.data.tokenizer import load_or_train_tokenizer

    check_resumable()
    d = recipe.data
    tokenizer = load_or_train_tokenizer(kind, d.tokenizer, (), d.vocab_size, Path(d.cache_dir).expanduser())  # loads it: nothing is trained
    return StreamedLM(tokenizer, source, recipe, rank, world_size)


class DocumentEncoder:
    """Documents to one flat array of token ids, each followed by the separator, as the token cache writes them."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase"):
        self.separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        if self.separator is None:
            raise UserError("The tokenizer has neither an EOS nor a SEP token to separate documents.")
        self.backend = fast_backend(tokenizer)

    def __call__(self, texts: list[str]) -> np.ndarray:
        return encode_documents(self.backend, texts, self.separator, np.int32) if texts else np.zeros(0, dtype=np.int32)


def token_chunks(
    stream: Stream, encode: DocumentEncoder, epoch: int, state: dict | None, endless: bool = True
) -> Iterator[tuple[int, dict | None, np.ndarray]]:
    """A rank's documents from (epoch, the dataset's state) on, as the tokens of each read batch with where
    it starts: (epoch, the dataset's state before it, tokens). Endless: at the stream's end the next epoch
    starts it again; an epoch without a token is refused, since it would never end."""
    dataset = stream.dataset
    while True:
        dataset.set_epoch(epoch)
        dataset.load_state_dict(state)  # None: from the epoch's start, with no earlier resume's state left behind
        batches, before, tokens_read = dataset.iter(batch_size=READ_BATCH), state, 0
        while True:
            try:
                table = next(batches)
            except StopIteration:
                break
            except (OSError, ValueError) as e:  # ValueError: text that is not UTF-8, JSON or Parquet that is not (pyarrow.ArrowInvalid)
                raise UserError(f"Could not read {stream.described}: {e}.") from e
            tokens = encode(list(documents(table.column(stream.field).to_pylist())))
            tokens_read += len(tokens)
            yield epoch, before, tokens
            before = dataset.state_dict()  # exact here, between batches
        if not endless:
            return
        if tokens_read == 0 and state is None:
            raise UserError(f"The part of the streamed {stream.described} read by rank {stream.rank} of {stream.world_size} holds no text.")
        epoch, state = epoch + 1, None


class BlockStream:
    """Consecutive blocks of ``length`` tokens cut from a rank's token chunks, documents running across
    block edges; ``position`` is where the next block starts."""

    def __init__(self, chunks: Callable[[int, dict | None], Iterator], length: int, position: dict):
        self.length = length
        self._chunks = chunks(position["epoch"], position["dataset"])
        self._next_chunk()
        self._skip(position["offset"])

    def _next_chunk(self) -> None:
        self.epoch, self.state, self.chunk = next(self._chunks)
        self.offset = 0

    def _skip(self, count: int) -> None:
        while True:
            taken = min(count, len(self.chunk) - self.offset)
            self.offset, count = self.offset + taken, count - taken
            if not count:
                return
            self._next_chunk()

    def position(self) -> dict:
        return {"epoch": self.epoch, "dataset": self.state, "offset": self.offset}

    def __next__(self) -> np.ndarray:
        parts, needed = [], self.length
        while needed:
            if self.offset == len(self.chunk):
                self._next_chunk()
            part = self.chunk[self.offset : self.offset + needed]
            parts.append(part)
            self.offset, needed = self.offset + len(part), needed - len(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def block_length(blocks_of: Callable[[np.ndarray], Blocks]) -> int:
    """The stream tokens in one of the task's blocks: seq_len for a causal LM, fewer for MLM's framing."""
    blocks = blocks_of(np.zeros(0, dtype=np.int64))
    return getattr(blocks, "stream", blocks).seq_len


class StreamingBatchLoader:
    """Endless micro-batches for one rank from its part of a stream; ``state_dict`` is the exact position.

    Windows of ``shuffle_window`` consecutive blocks (1 when 0: the stream's order) are taken in a
    permutation drawn from (seed, rank, window number); a micro-batch is the next ``micro_batch_size``
    blocks, across windows. MLM masks are keyed by (seed, rank, the block's number on this rank).
    """

    def __init__(
        self, stream: Stream, encode: DocumentEncoder, blocks_of, micro_batch_size: int, rank: int, world_size: int, seed: int, shuffle_window: int = 0
    ):
        self.stream, self.encode, self.micro_batch_size = stream, encode, micro_batch_size
        self.rank, self.world_size, self.seed, self.shuffle_window = rank, world_size, seed, shuffle_window
        self.block_len = block_length(blocks_of)
        self._rows = np.zeros(micro_batch_size * self.block_len, dtype=np.int64)  # a micro-batch's blocks, end to end
        self._batch_blocks = blocks_of(self._rows)
        self._start, self._number, self._taken, self._drawn = {"epoch": 0, "dataset": None, "offset": 0}, 0, 0, 0
        self._window = self._blocks = None  # read from _start when next needed

    def __iter__(self) -> "StreamingBatchLoader":
        return self

    def _chunks(self, epoch: int, state: dict | None) -> Iterator:
        return token_chunks(self.stream, self.encode, epoch, state)

    def _next_window(self) -> None:
        if self._blocks is None:  # after a resume (or at the start): read from the window's start
            self._blocks = BlockStream(self._chunks, self.block_len, self._start)
        elif self._window is not None:
            self._start, self._number, self._taken = self._blocks.position(), self._number + 1, 0
        size = max(1, self.shuffle_window)
        window = np.stack([next(self._blocks) for _ in range(size)])
        self._window = window[np.random.default_rng([self.seed, self.rank, self._number]).permutation(size)] if size > 1 else window

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        while len(rows) < self.micro_batch_size:
            if self._window is None or self._taken == len(self._window):
                self._next_window()
            taken = min(self.micro_batch_size - len(rows), len(self._window) - self._taken)
            rows.extend(self._window[self._taken : self._taken + taken])
            self._taken += taken
        self._rows[:] = np.concatenate(rows)
        numbers = np.arange(self._drawn, self._drawn + self.micro_batch_size)
        self._drawn += self.micro_batch_size
        return self._batch_blocks.batch(np.arange(self.micro_batch_size), sample_keys(numbers, self.seed, self.rank))

    def state_dict(self) -> dict:
        """The position (the current window's start, its number, the blocks taken of it, the blocks drawn) and what it means only together with."""
        position = {"stream": KIND, **self._start, "window": self._number, "taken": self._taken, "blocks": self._drawn}
        return position | {key: getattr(self, key) for key in _IDENTITY}

    def load_state_dict(self, state: dict) -> None:
        if state.get("stream") != KIND:
            raise UserError("Cannot resume the streamed data from a checkpoint of data read from the token cache; resume with data.streaming false.")
        if state["world_size"] != self.world_size:
            raise UserError(
                f"Cannot continue the streamed data of a checkpoint of {state['world_size']} ranks on {self.world_size}: each rank reads its own part "
                f"of the stream (data.streaming), whose position means nothing at another world size; resume on {state['world_size']} ranks."
            )
        for key in _IDENTITY:
            if state[key] != getattr(self, key):
                raise UserError(
                    f"Cannot resume the data loader: the checkpoint has {key}={state[key]} and this run {getattr(self, key)}; resume with the same data and seed."
                )
        self._start = {key: state[key] for key in ("epoch", "dataset", "offset")}
        self._number, self._taken, self._drawn = state["window"], state["taken"], state["blocks"]
        self._window = self._blocks = None


@functools.cache
def check_resumable() -> None:
    """Refuse a ``datasets`` whose stream position stops moving once resumed (huggingface/datasets#8308,
    in versions before its fix): a second resume would restart the stream from its first resume's place."""
    import datasets

    def probe():
        return datasets.Dataset.from_dict({"n": list(range(4))}).to_iterable_dataset(num_shards=1).with_format("arrow")

    whole = probe()
    batches = whole.iter(batch_size=1)
    next(batches)
    first = whole.state_dict()
    next(batches)
    resumed = probe()
    resumed.load_state_dict(first)
    next(resumed.iter(batch_size=1))
    if resumed.state_dict() != whole.state_dict():
        raise UserError(
            f"data.streaming needs a datasets whose stream position moves on after a resume, and datasets {datasets.__version__} keeps the "
            "position it resumed from (huggingface/datasets#8308), so a second resume would read the stream again; upgrade datasets."
        )
