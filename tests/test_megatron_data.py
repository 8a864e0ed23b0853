"""data.source megatron: Megatron-LM's indexed datasets (.bin + .idx) read by zoa-train's own reader
(zoa_train/data/indexed.py) and made into the training and validation token streams (data/megatron.py).

The files are written by megatron-core's own IndexedDatasetBuilder where it is installed
(`pip install --no-deps megatron-core==0.16.1`, as `make install` does); those tests skip without it.
Bad prefixes through the CLI are in tests/test_bad_input.py's table."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import one_sentence, zoa

from zoa_train.data import CausalLMBlocks, TextSource, prepare_lm_data
from zoa_train.data.indexed import read_indexed, write_indexed
from zoa_train.data.megatron import megatron_streams
from zoa_train.data.prepare import prepare_megatron_data
from zoa_train.data.token_stream import TokenStream
from zoa_train.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SEP = 0  # the separator of the synthetic corpora here


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's indexed_dataset module (its import warns of Apex and Transformer Engine, absent here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def corpus(seed: int, documents: int, low: int = 1, high: int = 100) -> list[list[np.ndarray]]:
    """Documents of 1-3 sentences of 1-7 token ids in [low, high), one document empty."""
    rng = np.random.default_rng(seed)
    docs = [[rng.integers(low, high, rng.integers(1, 8)) for _ in range(rng.integers(1, 4))] for _ in range(documents)]
    docs[documents // 2] = []
    return docs


def write_with_megatron(megatron, prefix: Path, docs: list[list[np.ndarray]], dtype) -> None:
    """One sequence per sentence, as preprocess_data.py --split-sentences writes them."""
    import torch

    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sentences in docs:
        for sentence in sentences:
            builder.add_item(torch.from_numpy(sentence.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def joined(sentences: list[np.ndarray]) -> list[int]:
    return [int(t) for s in sentences for t in s]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_files_written_by_megatron_core_read_back_identically(megatron, tmp_path, dtype):
    docs = corpus(0, 40)
    write_with_megatron(megatron, tmp_path / "corpus", docs, dtype)
    read = read_indexed(tmp_path / "corpus", "data.prefixes")
    theirs = megatron.IndexedDataset(str(tmp_path / "corpus"))
    assert read.tokens.dtype == dtype and read.num_documents == 40
    assert [read.document(i).tolist() for i in range(40)] == [joined(d) for d in docs]
    assert read.sequence_lengths.tolist() == [len(s) for d in docs for s in d] == theirs.sequence_lengths.tolist()
    assert read.document_indices.tolist() == theirs.document_indices.tolist()


def test_what_the_token_cache_writes_megatron_core_reads(megatron, tmp_path, cache_dir):
    docs = [np.arange(1 + i % 5, dtype=np.uint16) + i for i in range(30)]
    write_indexed(tmp_path / "ours", np.concatenate(docs), [len(d) for d in docs])
    theirs = megatron.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == 30 and theirs.index.dtype == np.uint16
    assert [theirs[i].tolist() for i in range(30)] == [d.tolist() for d in docs]
    # The cache of a real split: megatron-core reads its shard, one document a sequence, each followed by EOS.
    data = prepare_lm_data(TextSource("bundled"), "gpt2", cache_dir, vocab_size=8192)
    manifests = map(json.loads, map(Path.read_text, cache_dir.glob("tokens-*.json")))
    manifest = next(m for m in manifests if m["tokenizer"] == data.tokenizer.name_or_path and (m["source"], m["split"]) == ("bundled", "train"))
    shard = megatron.IndexedDataset(str(cache_dir / manifest["shards"][0]))
    stream = data.train
    first = np.concatenate([shard[i] for i in range(100)])
    assert shard[0][-1] == shard[99][-1] == data.tokenizer.eos_token_id and first.tolist() == stream[: len(first)].tolist()


def test_each_document_ends_with_the_separator_in_the_stream_whether_the_files_hold_it_or_not(tmp_path):
    docs = [[np.array([5, 6, 7])], [np.array([8]), np.array([9, SEP])], [], [np.array([4, 4])]] * 10  # some end with it already
    write_indexed(tmp_path / "a", np.concatenate([np.concatenate(d) for d in docs if d]).astype(np.uint16), [sum(map(len, d)) for d in docs])
    train, validation, files = megatron_streams([str(tmp_path / "a")], [], [], SEP)
    expected = [t for d in docs if d for t in joined(d) + ([] if joined(d)[-1] == SEP else [SEP])]
    assert isinstance(train, TokenStream) and len(files) == 1
    # 5% of the 40 documents held out, the last 2: [] and [4, 4]
    assert train[: len(train)].tolist() == expected[:-3] and validation[:].tolist() == [4, 4, SEP]
    # The blocks cut windows of the stream, across documents, as from the token cache's flat file.
    blocks = CausalLMBlocks(train, 4)
    assert blocks.rows(np.array([0, 2])).tolist() == [expected[0:4], expected[8:12]]


def test_a_blend_takes_each_prefix_at_its_weight_in_every_stretch_of_the_stream(tmp_path):
    sizes = {"small": 60, "large": 300}
    for name, count in sizes.items():  # ids tell the prefixes apart: small < 100 <= large
        low = 1 if name == "small" else 100
        docs = [np.random.default_rng(count + i).integers(low, low + 99, 1 + i % 9) for i in range(count)]
        write_indexed(tmp_path / name, np.concatenate([np.append(d, SEP) for d in docs]).astype(np.int32), [len(d) + 1 for d in docs])
    prefixes = [str(tmp_path / n) for n in sizes]
    small, large = (read_indexed(p, "data.prefixes") for p in prefixes)
    train, validation, _ = megatron_streams(prefixes, [0.6, 0.4], [prefixes[0]], SEP)
    tokens = train[:]
    source = np.repeat(train.pieces.source, train.pieces.length + train.pieces.separated)  # the prefix of each token
    # As many as the prefixes hold: each share runs over by less than a document (10 tokens at most here).
    assert abs(len(tokens) - len(small.tokens) - len(large.tokens)) < 2 * 10
    assert (source == 0).mean() == pytest.approx(0.6, abs=0.005)
    for stretch in np.array_split(source, 10):  # interleaved: each tenth of the stream holds the prefixes at their weights
        assert (stretch == 0).mean() == pytest.approx(0.6, abs=0.05)
    # The small prefix, upsampled, gives all its documents in order, again and again; the large one its first documents.
    assert np.array_equal(tokens[source == 0], np.resize(small.tokens, (source == 0).sum())) and (source == 0).sum() > 3 * len(small.tokens)
    assert np.array_equal(tokens[source == 1], large.tokens[: (source == 1).sum()])
    assert validation[:].tolist() == small.tokens.tolist()  # validation_prefixes: whole, unweighted


def test_token_ids_beyond_the_tokenizer_are_refused_in_one_sentence(tmp_path, cache_dir):
    trained = prepare_lm_data(TextSource("bundled"), "gpt2", cache_dir, vocab_size=8192).tokenizer
    tokenizer = trained.name_or_path
    write_indexed(tmp_path / "fits", np.array([1, 2, 8191, trained.eos_token_id] * 40, dtype=np.int32), [4] * 40)
    data = prepare_megatron_data([str(tmp_path / "fits")], [], [], tokenizer, "gpt2", tmp_path / "cache")
    assert len(data.tokenizer) == 8192 and len(data.train) == 38 * 4
    for ids, said in (([1, 8192], "holds the token id 8,192, beyond the 8,192 tokens of data.tokenizer"), ([-3, 5], "holds the token id -3")):
        write_indexed(tmp_path / "beyond", np.array(ids * 20, dtype=np.int32), [2] * 20)
        with pytest.raises(UserError) as refused:
            prepare_megatron_data([str(tmp_path / "fits"), str(tmp_path / "beyond")], [], [], tokenizer, "gpt2", tmp_path / f"cache{ids[0]}")
        one_sentence(str(refused.value), said, "beyond.bin")


@pytest.mark.slow
def test_two_ranks_train_gpt2_tiny_from_megatron_prefixes(tmp_path, cache_dir):
    """The token cache's own shards are Megatron prefixes: gpt2_tiny trains from them as data.source megatron."""
    tokenizer = prepare_lm_data(TextSource("bundled"), "gpt2", cache_dir, vocab_size=4096).tokenizer.name_or_path
    manifests = [json.loads(p.read_text()) for p in cache_dir.glob("tokens-*.json")]
    shards = {m["split"]: [str(cache_dir / s) for s in m["shards"]] for m in manifests if (m["tokenizer"], m["source"]) == (tokenizer, "bundled")}
    assert set(shards) == {"train", "validation"}
    sets = [
        "train.steps=2",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
        "data.source=megatron",
        f"data.prefixes={json.dumps(shards['train'])}",
        f"data.validation_prefixes={json.dumps(shards['validation'])}",
        f"data.tokenizer={tokenizer}",
    ]
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert 7.8 < records[0]["loss"] < 8.8  # about ln 4096 = 8.3 at the start: the 4,096-token tokenizer's vocabulary
