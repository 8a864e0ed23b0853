"""The token cache built in parallel (zoa_train/data/shards.py): worker processes write shard files in
Megatron's indexed format and a manifest last; the result is the one-process build's, token for token, and
a build that stops keeps its finished shards and completes from there."""

import json
import os
import socket
import subprocess

import numpy as np
import pytest

from zoa_train.data import TextSource, load_or_build_tokens, prepare_lm_data, shards
from zoa_train.data.indexed import read_indexed
from zoa_train.data.sources import bundled_paragraphs
from zoa_train.data.token_stream import TokenStream

PARAGRAPHS = 3000  # of the bundled corpus: 1.1M characters
SHARD_CHARS = 100_000  # 12 shards of them


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return prepare_lm_data(TextSource("bundled"), "gpt2", cache_dir, vocab_size=8192).tokenizer


@pytest.fixture
def corpus(tmp_path):
    """The bundled corpus's first paragraphs as a .txt file: a files source."""
    path = tmp_path / "austen.txt"
    path.write_text("\n\n".join(bundled_paragraphs()[:PARAGRAPHS]) + "\n")
    return TextSource("files", train_files=(str(path),), validation_files=(str(path),))


def shard_files(cache) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.glob("tokens-*_*.*"))}


@pytest.mark.slow  # worker processes
def test_the_parallel_build_equals_the_one_process_build_token_for_token(tokenizer, corpus, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(shards, "SHARD_CHARS", SHARD_CHARS)
    one = load_or_build_tokens(corpus, "train", tokenizer, tmp_path / "one", workers=1)
    capfd.readouterr()
    two = load_or_build_tokens(corpus, "train", tokenizer, tmp_path / "two", workers=2)
    assert "tokens/s" in capfd.readouterr().err  # the build's progress, with its rate
    assert isinstance(one, TokenStream) and len(one.arrays) > 10
    assert shard_files(tmp_path / "one") == shard_files(tmp_path / "two")  # every shard, byte for byte
    (manifest,) = [json.loads(p.read_text()) for p in (tmp_path / "two").glob("tokens-*.json")]
    assert manifest["num_tokens"] == len(two) == len(one) and manifest["num_documents"] == PARAGRAPHS
    # The shards together are the stream a single file held: each document's ids, then EOS.
    texts = bundled_paragraphs()[:50]
    expected = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert two[: len(expected)].tolist() == expected
    first = read_indexed(tmp_path / "two" / manifest["shards"][0], "the token cache")
    assert first.document(0).tolist() == tokenizer(texts[0])["input_ids"] + [tokenizer.eos_token_id]


def test_an_interrupted_build_keeps_its_finished_shards_and_completes(tokenizer, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "SHARD_CHARS", SHARD_CHARS)
    real, written = shards._write_shard, []

    def stopping(*args):
        if len(written) == 5:
            raise KeyboardInterrupt  # as if the job were stopped while it tokenized the sixth shard
        written.append(args[-1].name)
        return real(*args)

    monkeypatch.setattr(shards, "_write_shard", stopping)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        load_or_build_tokens(corpus, "train", tokenizer, cache, workers=1)
    kept = shard_files(cache)
    assert len(kept) == 2 * 5 and not list(cache.glob("*.json"))  # five shards whole, no manifest: not complete
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # nothing half-written
    name = written[0].rsplit("_", 1)[0]
    finished = subprocess.Popen(["true"])
    gone = finished.pid if finished.wait() == 0 else None  # a process id that no process has now
    abandoned = cache / f".{name}_00007.bin.tmp-{socket.gethostname()}-{gone}"  # what a killed writer of this host leaves
    elsewhere = cache / f".{name}_00008.bin.tmp-another-host-{gone}"  # a writer on another node, perhaps at work
    for path in (abandoned, elsewhere):
        path.write_bytes(b"\0" * 10)
    stamps = {name: os.stat(cache / name).st_mtime_ns for name in kept}

    written.clear()
    monkeypatch.setattr(shards, "_write_shard", lambda *args: (written.append(args[-1].name), real(*args))[1])
    resumed = load_or_build_tokens(corpus, "train", tokenizer, cache, workers=1)
    assert len(written) == len(resumed.arrays) - 5  # only the shards the first build did not finish
    assert {name: os.stat(cache / name).st_mtime_ns for name in kept} == stamps
    assert not abandoned.exists() and elsewhere.exists()
    monkeypatch.setattr(shards, "_write_shard", real)
    whole = load_or_build_tokens(corpus, "train", tokenizer, tmp_path / "whole", workers=1)
    assert shard_files(cache) == shard_files(tmp_path / "whole") and np.array_equal(resumed[:], whole[:])


def test_a_shard_lost_from_a_complete_cache_is_built_again(tokenizer, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "SHARD_CHARS", SHARD_CHARS)
    cache = tmp_path / "cache"
    before = load_or_build_tokens(corpus, "validation", tokenizer, cache, workers=1)[:]
    third = sorted(cache.glob("tokens-*_00002.bin"))[0]
    third.write_bytes(third.read_bytes()[:100])  # truncated behind the cache's back
    real, written = shards._write_shard, []
    monkeypatch.setattr(shards, "_write_shard", lambda *args: (written.append(args[-1].name), real(*args))[1])
    assert np.array_equal(load_or_build_tokens(corpus, "validation", tokenizer, cache, workers=1)[:], before)
    assert written == [third.stem]
