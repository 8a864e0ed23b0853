"""Streaming (data.streaming, zoa_train/data/streaming.py): documents read from a datasets IterableDataset
while training, tokenized on the fly and packed into blocks, each rank its own part of the stream, with a
position that resumes exactly however many times a run is resumed (or restarted by --max-restarts).

The corpora are written here (JSON lines, Parquet) from the bundled novels' paragraphs; the reference is
each document tokenized whole, followed by EOS, in order: what the token cache holds."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import one_sentence

from zoa_train.data import streaming
from zoa_train.data.lm import CausalLMBlocks
from zoa_train.data.prefetch import DevicePrefetcher
from zoa_train.data.sources import TextSource, bundled_paragraphs, open_stream
from zoa_train.data.streaming import DocumentEncoder, StreamedLM, StreamingBatchLoader, check_resumable
from zoa_train.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, MICRO = 32, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> SimpleNamespace:
    """Documents of every length (blank ones among them, which are not documents), in two JSON-lines files
    with a field besides the text, the same documents as one Parquet file, validation documents, and a
    small byte-level BPE tokenizer trained on them."""
    from zoa_train.data.tokenizer import load_or_train_tokenizer

    where = tmp_path_factory.mktemp("streamed")
    paragraphs = bundled_paragraphs()
    docs = [sentence for paragraph in paragraphs[:80] for sentence in re.split(r"(?<=[.!?;,]) ", paragraph)]  # clauses: about 14,000 tokens
    docs[7], docs[50] = "   ", ""  # skipped, as the token cache skips them
    halves = docs[: len(docs) // 2], docs[len(docs) // 2 :]  # each several read batches (streaming.READ_BATCH)
    for name, part in zip(("a.jsonl", "b.jsonl"), halves):
        (where / name).write_text("".join(json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(part)))
    (where / "val.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in paragraphs[300:400]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), where / "all.parquet", row_group_size=37)
    tokenizer = load_or_train_tokenizer("gpt2", None, paragraphs[:2000], 512, where / "tokenizer")
    return SimpleNamespace(where=where, docs=docs, halves=halves, tokenizer=tokenizer)


def reference(tokenizer, docs: list[str]) -> np.ndarray:
    """The documents tokenized whole, each followed by EOS: the stream the blocks are cut from."""
    ids = [tokenizer(doc.strip(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for doc in docs if doc.strip()]
    return np.concatenate(ids)


def loader(corpus, files: list[str], rank: int = 0, world_size: int = 1, shuffle_window: int = 0, seed: int = 0) -> StreamingBatchLoader:
    source = TextSource("files", train_files=tuple(str(corpus.where / f) for f in files))
    stream = open_stream(source, "train", rank, world_size)
    return StreamingBatchLoader(stream, DocumentEncoder(corpus.tokenizer), lambda t: CausalLMBlocks(t, SEQ_LEN), MICRO, rank, world_size, seed, shuffle_window)


def tokens_of(batches, count: int) -> np.ndarray:
    """The first `count` micro-batches' tokens, end to end."""
    return np.concatenate([next(batches)["input_ids"].numpy().ravel() for _ in range(count)])


@pytest.mark.parametrize("files", [["a.jsonl", "b.jsonl"], ["all.parquet"]], ids=["json lines", "parquet"])
def test_one_rank_reads_the_documents_in_order_as_if_tokenized_whole(corpus, files):
    whole = reference(corpus.tokenizer, corpus.docs)
    batches = 2 * len(whole) // (MICRO * SEQ_LEN) + 3  # into the third pass over the stream
    got = tokens_of(loader(corpus, files), batches)
    assert got[: len(whole)].tolist() == whole.tolist()
    # The next pass continues the last block (no token dropped at the stream's end), the files in
    # datasets' order for that epoch.
    second = got[len(whole) : 2 * len(whole)]
    expected = [reference(corpus.tokenizer, corpus.halves[1] + corpus.halves[0]), whole] if len(files) == 2 else [whole]
    assert any(second.tolist() == e.tolist() for e in expected)


@pytest.mark.parametrize("files", [["a.jsonl", "b.jsonl"], ["all.parquet"]], ids=["a file per rank", "every other document"])
def test_two_ranks_read_disjoint_parts_that_together_are_the_whole_stream(corpus, files):
    # Two files on two ranks: a file each; one file: every other document each.
    parts = list(corpus.halves) if len(files) == 2 else [corpus.docs[0::2], corpus.docs[1::2]]
    assert sorted(parts[0] + parts[1]) == sorted(corpus.docs)  # disjoint, and together every document
    for rank, docs in enumerate(parts):
        own = reference(corpus.tokenizer, docs)
        got = tokens_of(loader(corpus, files, rank, 2), len(own) // (MICRO * SEQ_LEN))
        assert got.tolist() == own[: len(got)].tolist()


def test_validation_blocks_are_the_head_of_each_ranks_part_of_the_validation_files(corpus):
    source = TextSource("files", train_files=(str(corpus.where / "a.jsonl"),), validation_files=(str(corpus.where / "val.jsonl"),))
    recipe = SimpleNamespace(train=SimpleNamespace(val_batches=3, micro_batch_size=MICRO, seed=0), data=SimpleNamespace(shuffle_window=0))
    docs = [json.loads(line)["text"] for line in (corpus.where / "val.jsonl").read_text().splitlines()]
    for rank in range(2):
        blocks = StreamedLM(corpus.tokenizer, source, recipe, rank, 2).validation(lambda t: CausalLMBlocks(t, SEQ_LEN))
        assert len(blocks) == 3 * MICRO
        assert blocks.tokens.tolist() == reference(corpus.tokenizer, docs[rank::2])[: 3 * MICRO * SEQ_LEN].tolist()


def test_a_shuffle_window_takes_each_window_of_blocks_in_a_seeded_order(corpus):
    window = 6  # not a multiple of the micro-batch: windows run across micro-batches
    in_order = tokens_of(loader(corpus, ["all.parquet"]), 30).reshape(-1, window, SEQ_LEN)
    shuffled = tokens_of(loader(corpus, ["all.parquet"], shuffle_window=window), 30).reshape(-1, window, SEQ_LEN)
    again = tokens_of(loader(corpus, ["all.parquet"], shuffle_window=window), 30).reshape(-1, window, SEQ_LEN)
    other_seed = tokens_of(loader(corpus, ["all.parquet"], shuffle_window=window, seed=1), 30).reshape(-1, window, SEQ_LEN)
    for a, b in zip(in_order, shuffled):
        assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist()))  # the same blocks in each window
    assert not np.array_equal(in_order, shuffled) and np.array_equal(shuffled, again) and not np.array_equal(shuffled, other_seed)


def saved_and_loaded(state: dict, tmp_path: Path) -> dict:
    """The position through a checkpoint file, read back as the trainer reads it (weights only: plain values)."""
    torch.save({"loader": state}, tmp_path / "rank.pt")
    return torch.load(tmp_path / "rank.pt", weights_only=True)["loader"]


@pytest.mark.parametrize("read_batch", [1, streaming.READ_BATCH], ids=["a document a read", "the default read"])
def test_a_resumed_loader_continues_exactly_however_often_it_is_resumed(corpus, tmp_path, read_batch, monkeypatch):
    """Through the trainer's prefetcher (its position is before the batch it fetched ahead), on rank 1 of 2,
    in a shuffle window of 5 blocks (micro-batches of 4 run across windows), resumed three times: at
    positions inside a window, inside a pass of the stream and past its end."""
    monkeypatch.setattr(streaming, "READ_BATCH", read_batch)

    def batches(state=None):
        prefetcher = DevicePrefetcher(loader(corpus, ["all.parquet"], 1, 2, shuffle_window=5), lambda batch, device: batch, torch.device("cpu"))
        if state is not None:
            prefetcher.load_state_dict(saved_and_loaded(state, tmp_path))
        return prefetcher

    uninterrupted = batches()
    expected = [next(uninterrupted)["input_ids"] for _ in range(130)]
    run, got, states = batches(), [], []
    for stop in (33, 88, 121, 130):  # each segment a new loader resumed from the last one's position
        got += [next(run)["input_ids"] for _ in range(stop - len(got))]
        states.append(run.state_dict())
        run = batches(states[-1])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert [s["epoch"] for s in states[:3]] == [0, 1, 2] and any(0 < s["taken"] < 5 for s in states)  # each pass of the stream, inside windows
    assert sum(s["dataset"] is not None for s in states[:3]) >= 2  # past a pass's first read: where datasets' own position is needed


def test_masked_lm_sentence_pairs_stream_and_resume_with_the_same_masks(corpus, tmp_path):
    """BERT's blocks ([CLS] A [SEP] B [SEP], masked) from the stream, documents separated by [SEP]; masks
    are keyed by each block's number on its rank, so a resumed loader masks as the uninterrupted one."""
    from zoa_train.data.lm import IGNORE_INDEX, SentencePairBlocks
    from zoa_train.data.tokenizer import load_or_train_tokenizer

    tokenizer = load_or_train_tokenizer("bert", None, corpus.docs, 300, tmp_path / "bert")
    source = TextSource("files", train_files=(str(corpus.where / "all.parquet"),))

    def make() -> StreamingBatchLoader:
        blocks = lambda tokens: SentencePairBlocks(tokens, SEQ_LEN, tokenizer)
        return StreamingBatchLoader(open_stream(source, "train"), DocumentEncoder(tokenizer), blocks, MICRO, 0, 1, 0, shuffle_window=3)

    run = make()
    first = [next(run) for _ in range(5)]
    state = run.state_dict()
    expected = [next(run) for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(expected, [next(resumed) for _ in range(4)]) for k in a)
    batch = first[0]
    assert batch["input_ids"].shape == (MICRO, SEQ_LEN) and (batch["labels"] != IGNORE_INDEX).any()
    assert (batch["input_ids"][:, 0] == tokenizer.cls_token_id).all() and batch["next_sentence_label"].shape == (MICRO,)


def test_a_streamed_position_is_refused_at_another_world_size_in_one_sentence(corpus):
    two = loader(corpus, ["all.parquet"], 1, 2)
    next(two)
    with pytest.raises(UserError) as refused:
        loader(corpus, ["all.parquet"], 0, 1).load_state_dict(two.state_dict())
    one_sentence(str(refused.value), "checkpoint of 2 ranks on 1", "resume on 2 ranks")
    with pytest.raises(UserError, match="token cache; resume with data.streaming false"):
        loader(corpus, ["all.parquet"]).load_state_dict({"epoch": 0, "sample": 0, "micro": 0})


def test_a_stream_without_the_text_field_is_refused_in_one_sentence(corpus):
    with pytest.raises(UserError) as refused:
        open_stream(TextSource("files", train_files=(str(corpus.where / "a.jsonl"),), text_field="body"), "train")
    one_sentence(str(refused.value), "data.text_field 'body' is not a field of the streamed data files", "a.jsonl, whose fields are id, text")


def test_a_datasets_whose_position_stops_moving_after_a_resume_is_refused(monkeypatch):
    """huggingface/datasets#8308: the state after a resume stayed where the resume began (then a second
    resume read the stream again); here the resume itself is lost, which the same check sees."""
    import datasets

    check_resumable.__wrapped__()  # this datasets is sound
    monkeypatch.setattr(datasets.IterableDataset, "load_state_dict", lambda self, state: None)
    with pytest.raises(UserError, match=r"datasets#8308\), so a second resume would read the stream again; upgrade datasets\.$"):
        check_resumable.__wrapped__()


# ---- a real run: 2 ranks, stopped, resumed, a rank killed and restarted, against an uninterrupted run ----


def streamed_run(corpus, run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    sets = [
        "data.source=files",
        f"data.train_files=[{corpus.where / 'a.jsonl'}, {corpus.where / 'b.jsonl'}]",  # a file each rank
        f"data.validation_files=[{corpus.where / 'val.jsonl'}]",
        "data.streaming=true",
        f"data.tokenizer={corpus.where / 'tokenizer'}",
        "data.shuffle_window=24",  # windows of 1.5 micro-batches: resumes inside them
        f"data.cache_dir={cache_dir}",
        "train.steps=16",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=4",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        *extra,
    ]
    return [sys.executable, "-m", "zoa_train.cli", "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *[a for s in sets for a in ("--set", s)]]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow  # three 2-rank runs and a restart (the uninterrupted one beside the others)
def test_a_streamed_run_resumed_and_restarted_trains_as_an_uninterrupted_one(corpus, tmp_path, cache_dir):
    """Each rank's file is about 7 steps of blocks: the run stops at step 4 in the first pass of the stream,
    is resumed, a rank is killed after the resumed run's checkpoint of step 12 (the second pass) and every
    rank restarts from it (--max-restarts): the same losses at every step as if the run never stopped."""
    import os
    import signal
    import time

    from test_faults import rank_pids

    def started(command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finished(run: subprocess.Popen) -> str:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
        return stderr

    whole, run_dir = tmp_path / "whole", tmp_path / "resumed"
    uninterrupted = started(streamed_run(corpus, whole, cache_dir))
    finished(started(streamed_run(corpus, run_dir, cache_dir, "train.steps=4")))
    resumed = started([*streamed_run(corpus, run_dir, cache_dir), "--resume", "auto", "--max-restarts", "1"])
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "step_00000012" / "COMPLETE").exists():
        assert resumed.poll() is None and time.monotonic() < deadline, resumed.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(rank_pids(resumed.pid)[1], signal.SIGKILL)
    stderr = finished(resumed)
    restarted = re.search(r"restart 1 after a rank failed: every rank resumed from \S+ \(step (\d+)\)", stderr)
    assert restarted and int(restarted.group(1)) >= 12, stderr[-3000:]  # from a checkpoint the resumed run wrote
    finished(uninterrupted)

    assert losses(run_dir) == losses(whole) and [step for step, _ in losses(whole)] == list(range(1, 17))
    for step in (4, int(restarted.group(1))):  # both resumes stood past the first read of a pass: datasets' own position was needed
        assert all(torch.load(run_dir / "checkpoints" / f"step_{step:08d}" / f"rank_{r:05d}.pt", weights_only=True)["loader"]["dataset"] for r in range(2))
    final = [d / "checkpoints" / "step_00000016" for d in (whole, run_dir)]
    a, b = (torch.load(f / "model.pt", weights_only=True) for f in final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for rank in range(2):  # each rank's position in its stream
        a, b = (torch.load(f / f"rank_{rank:05d}.pt", weights_only=True)["loader"] for f in final)
        assert a == b and a["epoch"] >= 1
