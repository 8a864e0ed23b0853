"""zoa_train.data: bundled corpus, text sources, tokenizers, token cache, LM batches and the distributed loader."""

import itertools
import json
import lzma
import re
import threading
import time

import numpy as np
import pytest
import torch

from zoa_train.data import (
    BUNDLED_CORPUS,
    IGNORE_INDEX,
    CausalLMBlocks,
    DistributedBatchLoader,
    MaskedLMBlocks,
    SentencePairBlocks,
    TextSource,
    iter_texts,
    load_or_build_tokens,
    load_or_train_tokenizer,
    prepare_lm_data,
    shards,
    validation_batches,
)
from zoa_train.data.lm import sample_keys
from zoa_train.data.sources import bundled_paragraphs
from zoa_train.errors import UserError

SENTENCE = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."


@pytest.fixture(scope="module")
def gpt2(cache_dir):
    return prepare_lm_data(TextSource("bundled"), "gpt2", cache_dir, vocab_size=8192)


@pytest.fixture(scope="module")
def bert(cache_dir):
    return prepare_lm_data(TextSource("bundled"), "bert", cache_dir, vocab_size=8192)


@pytest.fixture
def count_encodes(monkeypatch):
    """Counts calls to the token cache's encoder, i.e. whether anything was tokenized."""
    calls = []
    real = shards.encode_documents

    def counting(*args):
        calls.append(len(args[1]))
        return real(*args)

    monkeypatch.setattr(shards, "encode_documents", counting)
    return calls


def write_txt(path, paragraphs):
    path.write_text("\n\n".join(paragraphs) + "\n")
    return str(path)


# --- bundled corpus ---------------------------------------------------------------------------


def test_bundled_corpus_is_over_a_megabyte_of_english_prose():
    text = lzma.decompress(BUNDLED_CORPUS.read_bytes()).decode("utf-8")
    assert len(text.encode()) >= 1_000_000
    assert BUNDLED_CORPUS.stat().st_size < 1_100_000
    letters_and_spaces = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters_and_spaces / len(text) > 0.9
    words = re.findall(r"[a-z]+", text.lower())
    assert len(set(words)) > 10_000
    common = {w: words.count(w) for w in ("the", "and", "of", "to", "her")}
    assert all(n > 5000 for n in common.values()), common
    notice = (BUNDLED_CORPUS.parent / "NOTICE.md").read_text()
    assert "public domain" in notice and "r-cran-janeaustenr" in notice


def test_bundled_validation_split_is_the_held_out_tail():
    paragraphs = bundled_paragraphs()
    train = list(iter_texts(TextSource(), "train"))
    validation = list(iter_texts(TextSource(), "validation"))
    assert train + validation == paragraphs
    assert 0.04 < len(validation) / len(paragraphs) < 0.06


# --- local files and the hub ------------------------------------------------------------------


def test_txt_files_by_paragraph_or_whole_file(tmp_path):
    train = write_txt(tmp_path / "train.txt", ["First paragraph,\nwrapped.", "Second one.", "Third."])
    val = write_txt(tmp_path / "val.txt", ["Held out."])
    source = TextSource("files", train_files=(train,), validation_files=(val,))
    assert list(iter_texts(source, "train", tmp_path / "hf")) == ["First paragraph,\nwrapped.", "Second one.", "Third."]
    assert list(iter_texts(source, "validation", tmp_path / "hf")) == ["Held out."]
    whole = TextSource("files", train_files=(train, val), txt_sample_by="document", validation_fraction=0.5)
    assert list(iter_texts(whole, "validation", tmp_path / "hf")) == ["Held out."]


def test_jsonl_with_a_named_field_and_held_out_tail(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": f"Document number {i}.", "id": i}) + "\n" for i in range(20)))
    source = TextSource("files", train_files=(str(path),), text_field="body", validation_fraction=0.1)
    assert list(iter_texts(source, "train", tmp_path / "hf")) == [f"Document number {i}." for i in range(18)]
    assert list(iter_texts(source, "validation", tmp_path / "hf")) == ["Document number 18.", "Document number 19."]
    with pytest.raises(UserError, match="'text'"):
        list(iter_texts(TextSource("files", train_files=(str(path),)), "train", tmp_path / "hf"))


def test_parquet_text_column_and_globs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in range(2):
        table = pa.table({"text": [f"Part {part} row {i}." for i in range(3)] + ["  "]})
        pq.write_table(table, tmp_path / f"part-{part}.parquet")
    source = TextSource("files", train_files=(str(tmp_path / "part-*.parquet"),), validation_fraction=0.25)
    train = list(iter_texts(source, "train", tmp_path / "hf"))
    assert train == ["Part 0 row 0.", "Part 0 row 1.", "Part 0 row 2.", "Part 1 row 0.", "Part 1 row 1."]


def test_missing_or_unsupported_files_are_user_errors(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(UserError, match=re.escape(missing)):
        list(iter_texts(TextSource("files", train_files=(missing,)), "train"))
    with pytest.raises(UserError, match="No data file matches"):
        list(iter_texts(TextSource("files", train_files=(str(tmp_path / "*.jsonl"),)), "train"))
    csv = tmp_path / "a.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(UserError, match="unsupported extension"):
        list(iter_texts(TextSource("files", train_files=(str(csv),)), "train"))


def test_hub_dataset_offline_is_a_clear_user_error(monkeypatch, tmp_path):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # the env var is read at import
    source = TextSource("wikitext", config="wikitext-103-raw-v1")
    with pytest.raises(UserError, match=r"wikitext.*wikitext-103-raw-v1.*bundled"):
        list(iter_texts(source, "train", tmp_path / "hf"))


# --- tokenizers -------------------------------------------------------------------------------


def test_gpt2_bpe_round_trip(gpt2, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = gpt2.tokenizer
    assert len(tok) == 8192 and tok.eos_token == "<|endoftext|>"
    ids = tok(SENTENCE)["input_ids"]
    assert tok.decode(ids) == SENTENCE  # byte-level: lossless
    assert len(ids) < len(SENTENCE.split()) * 1.5  # whole words, not characters
    for reloaded in (AutoTokenizer.from_pretrained(tok.name_or_path), PreTrainedTokenizerFast.from_pretrained(tok.name_or_path)):
        assert reloaded(SENTENCE)["input_ids"] == ids and reloaded.eos_token_id == tok.eos_token_id
    # A saved tokenizer given by path loads as a pretrained one.
    again = load_or_train_tokenizer("gpt2", tok.name_or_path, [], 0, tmp_path / "unused")
    assert again(SENTENCE)["input_ids"] == ids


def test_bert_wordpiece_round_trip(bert):
    from transformers import AutoTokenizer

    tok = bert.tokenizer
    assert len(tok) == 8192
    assert tok.convert_ids_to_tokens(list(range(5))) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ids = tok(SENTENCE)["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True).replace(" ,", ",").replace(" .", ".") == SENTENCE.lower()
    reloaded = AutoTokenizer.from_pretrained(tok.name_or_path)
    assert reloaded(SENTENCE)["input_ids"] == ids and reloaded.mask_token == "[MASK]"


def test_trained_tokenizer_is_reused_and_missing_dirs_are_user_errors(gpt2, tmp_path):
    def must_not_be_read():
        raise AssertionError("the tokenizer was trained again")
        yield

    again = load_or_train_tokenizer("gpt2", None, must_not_be_read(), 8192, gpt2.tokenizer.name_or_path)
    assert again(SENTENCE)["input_ids"] == gpt2.tokenizer(SENTENCE)["input_ids"]
    with pytest.raises(UserError, match="does not exist"):
        load_or_train_tokenizer("bert", str(tmp_path / "no-such-tokenizer"), [], 100, tmp_path / "x")
    with pytest.raises(UserError, match="kind"):
        load_or_train_tokenizer("t5", None, [], 100, tmp_path / "x")


# --- token cache ------------------------------------------------------------------------------


def test_token_cache_matches_the_tokenizer_and_is_reused(gpt2, cache_dir, tmp_path, count_encodes):
    docs = [f"Paragraph {i}: {SENTENCE}" for i in range(40)]
    source = TextSource("files", train_files=(write_txt(tmp_path / "a.txt", docs),))
    first = load_or_build_tokens(source, "train", gpt2.tokenizer, tmp_path / "cache")
    assert count_encodes
    expected = [t for d in docs[:-2] for t in gpt2.tokenizer(d)["input_ids"] + [gpt2.tokenizer.eos_token_id]]
    assert first.dtype == np.uint16 and first.tolist() == expected

    count_encodes.clear()
    second = load_or_build_tokens(source, "train", gpt2.tokenizer, tmp_path / "cache")
    assert not count_encodes and np.array_equal(first, second)
    # The bundled splits were built once, by the fixture.
    assert len(load_or_build_tokens(TextSource(), "validation", gpt2.tokenizer, cache_dir)) > 40_000
    assert not count_encodes

    # A changed file is a new cache entry, not a stale hit.
    time.sleep(0.01)
    write_txt(tmp_path / "a.txt", docs[:10])
    assert len(load_or_build_tokens(source, "train", gpt2.tokenizer, tmp_path / "cache")) < len(first)
    assert count_encodes


def test_token_cache_never_leaves_a_partial_file(gpt2, tmp_path, monkeypatch):
    source = TextSource("files", train_files=(write_txt(tmp_path / "a.txt", [SENTENCE] * 100),))
    cache = tmp_path / "cache"
    monkeypatch.setattr(shards, "ENCODE_BATCH", 10)
    real, calls = shards.encode_documents, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if the job were killed mid-write
        return real(*args)

    monkeypatch.setattr(shards, "encode_documents", failing)
    with pytest.raises(KeyboardInterrupt):
        load_or_build_tokens(source, "train", gpt2.tokenizer, cache)
    assert [p.suffix for p in cache.iterdir() if p.is_file()] == [".lock"]  # no .bin, no .json, no temporary file
    monkeypatch.setattr(shards, "encode_documents", real)
    assert len(load_or_build_tokens(source, "train", gpt2.tokenizer, cache)) > 0


def test_concurrent_ranks_build_the_cache_once(gpt2, tmp_path, monkeypatch):
    source = TextSource("files", train_files=(write_txt(tmp_path / "a.txt", [SENTENCE] * 200),))
    real, builds = shards.build_shards, []

    def slow_build(*args):
        builds.append(1)
        time.sleep(0.3)  # widen the window in which the other rank arrives
        return real(*args)

    monkeypatch.setattr(shards, "build_shards", slow_build)
    results = [None, None]

    def rank(r):
        results[r] = load_or_build_tokens(source, "train", gpt2.tokenizer, tmp_path / "cache")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]  # flock also excludes threads: separate opens
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and np.array_equal(results[0], results[1])


# --- blocks, masking, loader ------------------------------------------------------------------


def numbered_blocks(num_blocks, seq_len=4):
    """A token stream whose block i is filled with the value i, to read block indices back from batches."""
    return CausalLMBlocks(np.repeat(np.arange(num_blocks, dtype=np.uint16), seq_len), seq_len)


def test_causal_blocks_tile_the_stream_and_labels_are_inputs(gpt2):
    blocks = CausalLMBlocks(gpt2.train, 128)
    assert len(blocks) == len(gpt2.train) // 128
    batch = blocks.batch(np.array([5, 6, 0]), sample_keys(np.array([5, 6, 0]), 0))
    assert batch["input_ids"].shape == (3, 128) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"], batch["input_ids"])  # HF convention: the model shifts
    stream = torch.from_numpy(gpt2.train[5 * 128 : 7 * 128].astype(np.int64))
    assert torch.equal(batch["input_ids"][:2].flatten(), stream)
    assert torch.equal(batch["input_ids"][2], torch.from_numpy(gpt2.train[:128].astype(np.int64)))


def test_mlm_masking_rates_specials_and_determinism(bert):
    tok = bert.tokenizer
    blocks = MaskedLMBlocks(bert.train, 128, tok)
    indices = np.arange(512)
    keys = sample_keys(indices, 1, 0, 7)
    batch = blocks.batch(indices, keys)
    original = torch.cat([torch.full((512, 1), tok.cls_token_id), blocks.stream.rows(indices), torch.full((512, 1), tok.sep_token_id)], dim=1)
    ids, labels = batch["input_ids"], batch["labels"]
    special = torch.isin(original, torch.tensor(tok.all_special_ids))
    assert special[:, 0].all() and special[:, -1].all() and special[:, 1:-1].any()  # documents' [SEP]s inside blocks too
    chosen = labels != IGNORE_INDEX
    assert not (chosen & special).any() and torch.equal(ids[special], original[special])
    assert torch.equal(labels[chosen], original[chosen])
    assert abs(chosen.sum() / (~special).sum() - 0.15) < 0.005
    masked = (ids[chosen] == tok.mask_token_id).float().mean()
    unchanged = (ids[chosen] == original[chosen]).float().mean()
    assert abs(masked - 0.8) < 0.015 and abs(unchanged - 0.1) < 0.015 and abs(1 - masked - unchanged - 0.1) < 0.015
    assert torch.equal(ids[~chosen], original[~chosen])

    same = blocks.batch(indices, keys)
    assert torch.equal(same["input_ids"], ids) and torch.equal(same["labels"], labels)
    for other in (sample_keys(indices, 1, 0, 8), sample_keys(indices, 1, 1, 7), sample_keys(indices, 2, 0, 7)):
        assert not torch.equal(blocks.batch(indices, other)["labels"], labels)
    # A row's masking is its key's alone: the same rows, reordered and in a smaller batch, are masked alike.
    picked = np.array([300, 7, 41])
    alone = blocks.batch(indices[picked], keys[picked])
    assert torch.equal(alone["input_ids"], ids[picked]) and torch.equal(alone["labels"], labels[picked])


def test_sentence_pairs_for_the_next_sentence_head(bert):
    tok = bert.tokenizer
    blocks = SentencePairBlocks(bert.train, 64, tok)
    indices = np.arange(400)
    batch = blocks.batch(indices, sample_keys(indices, 3, 0, 1))
    ids, labels, types, is_random = batch["input_ids"], batch["labels"], batch["token_type_ids"], batch["next_sentence_label"]
    half = blocks.half
    assert ids.shape == types.shape == (400, 64) and is_random.shape == (400,)
    assert (ids[:, 0] == tok.cls_token_id).all() and (ids[:, half + 1] == tok.sep_token_id).all() and (ids[:, -1] == tok.sep_token_id).all()
    assert (types[:, : half + 2] == 0).all() and (types[:, half + 2 :] == 1).all()
    assert 0.4 < is_random.float().mean() < 0.6
    original = ids.clone()
    original[labels != IGNORE_INDEX] = labels[labels != IGNORE_INDEX]  # undo the masking
    stream = blocks.stream.rows(indices)
    assert torch.equal(original[:, 1 : half + 1], stream[:, :half])  # A is always the block's first half
    kept = is_random == 0
    assert torch.equal(original[kept, half + 2 : -1], stream[kept, half:])  # B follows A unless drawn at random
    assert not torch.equal(original[~kept, half + 2 : -1], stream[~kept, half:])


def take_global_batches(blocks, layout, global_batch_size, steps, seed=3, state=None):
    """`steps` global batches as every rank of `layout` (world size, micro-batch size) takes them: per step,
    each rank's micro-batches concatenated in order, rank after rank; and the ranks' loaders."""
    world, micro = layout
    loaders = [DistributedBatchLoader(blocks, micro, rank, world, seed, global_batch_size) for rank in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # as it would come back from a checkpoint
    accumulation = global_batch_size // (world * micro)
    steps_taken = []
    for _ in range(steps):
        ranks = [[next(loader) for _ in range(accumulation)] for loader in loaders]
        steps_taken.append([{k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]} for micro_batches in ranks])
    return steps_taken, loaders


def ids(step: list[dict]) -> list[int]:
    """A global batch's block ids (numbered_blocks), rank after rank."""
    return torch.cat([rank["input_ids"][:, 0] for rank in step]).tolist()


def permutation(epoch: int, count: int = 103, seed: int = 3) -> list[int]:
    """The global order of an epoch: a function of the seed and the sample index alone."""
    return np.random.default_rng([seed, epoch]).permutation(count).tolist()


@pytest.mark.parametrize("layout", [(1, 24), (1, 6), (2, 12), (2, 4), (3, 8), (3, 4), (3, 2)], ids=lambda x: f"{x}")
def test_a_global_batch_is_the_same_blocks_in_the_same_order_at_any_world_size_and_micro_batch(layout):
    blocks = numbered_blocks(103)  # 4 global batches of 24 an epoch, 7 blocks skipped
    steps, loaders = take_global_batches(blocks, layout, 24, 10)
    accumulation = 24 // (layout[0] * layout[1])
    assert len(loaders[0]) == 4 * accumulation
    for step, ranks in enumerate(steps):
        epoch, index = divmod(step, 4)
        # rank r takes the r-th slice of the global batch, its micro-batches in order: ranks are disjoint
        assert ids(ranks) == permutation(epoch)[24 * index : 24 * (index + 1)]
        assert len(set(ids(ranks))) == 24 and all(len(rank["input_ids"]) == 24 // layout[0] for rank in ranks)
    assert len(set(sum((ids(ranks) for ranks in steps[:4]), []))) == 96  # an epoch takes no block twice


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_resume_from_any_position_gives_the_same_batches_as_an_uninterrupted_run(kind, gpt2, bert):
    data = gpt2 if kind == "gpt2" else bert
    tokens = data.validation[: 32 * 100]  # 100 blocks: 4 global batches of 24 an epoch
    blocks = CausalLMBlocks(tokens, 32) if kind == "gpt2" else MaskedLMBlocks(tokens, 32, data.tokenizer)

    def loader(seed=11):
        return DistributedBatchLoader(blocks, 4, rank=1, world_size=3, seed=seed, global_batch_size=24)  # 2 micro-batches a step

    reference = list(itertools.islice(loader(), 14))  # into the second epoch
    for taken in range(len(reference)):  # between global batches, inside one, at an epoch's end
        interrupted = loader()
        for _ in range(taken):
            next(interrupted)
        state = json.loads(json.dumps(interrupted.state_dict()))
        resumed = loader()
        resumed.load_state_dict(state)
        for expected in reference[taken:]:
            batch = next(resumed)
            assert all(torch.equal(batch[k], expected[k]) for k in expected)
    inside = loader()
    next(inside)
    with pytest.raises(UserError, match="inside a global batch"):
        DistributedBatchLoader(blocks, 4, rank=1, world_size=2, seed=11, global_batch_size=24).load_state_dict(inside.state_dict())
    with pytest.raises(UserError, match="checkpoint has seed=11 and this run 12"):
        loader(seed=12).load_state_dict(state)


@pytest.mark.parametrize("taken", [1, 3, 4, 6], ids=lambda n: f"after{n}")
def test_a_position_continues_at_another_world_size_and_micro_batch_at_the_next_unseen_global_batch(taken):
    blocks = numbered_blocks(103)
    reference, _ = take_global_batches(blocks, (2, 4), 24, 10)
    _, loaders = take_global_batches(blocks, (2, 4), 24, taken)
    states = [loader.state_dict() for loader in loaders]
    assert states[0] == states[1]  # between global batches every rank is at the same place
    for layout in ((1, 6), (3, 4), (3, 8), (2, 12)):
        continued, _ = take_global_batches(blocks, layout, 24, 10 - taken, state=states[0])
        assert [ids(ranks) for ranks in continued] == [ids(ranks) for ranks in reference[taken:]]


def test_another_global_batch_size_continues_at_the_next_unseen_block():
    blocks = numbered_blocks(103)
    _, loaders = take_global_batches(blocks, (2, 4), 24, 3)  # 72 blocks of epoch 0 taken, 31 left
    state = loaders[0].state_dict()
    smaller, _ = take_global_batches(blocks, (2, 8), 16, 3, state=state)
    # the next unseen 16, then 15 are left, fewer than a global batch: skipped, the next epoch begins
    assert [ids(ranks) for ranks in smaller] == [permutation(0)[72:88], permutation(1)[:16], permutation(1)[16:32]]
    larger, _ = take_global_batches(blocks, (1, 8), 32, 1, state=state)  # 31 left are fewer than 32
    assert ids(larger[0]) == permutation(1)[:32]


def test_positions_saved_before_the_global_order_continue_at_the_same_sample():
    blocks = numbered_blocks(103)
    # 5 steps of the old loader at 2 ranks x 4, one micro-batch a step: rank r took permutation[8 b + 4 r : 8 b + 4 r + 4] at step b
    old = {"epoch": 1, "batch_index": 5, "seed": 3, "world_size": 2, "micro_batch_size": 4, "num_blocks": 103}
    same, _ = take_global_batches(blocks, (2, 4), 8, 2, state=old)
    assert [rank["input_ids"][:, 0].tolist() for rank in same[0]] == [permutation(1)[40:44], permutation(1)[44:48]]  # the old loader's next
    other, _ = take_global_batches(blocks, (3, 4), 24, 1, state=old)
    assert ids(other[0]) == permutation(1)[40:64]


def test_mlm_masks_are_the_same_per_block_at_any_world_size_and_differ_between_epochs(bert):
    blocks = MaskedLMBlocks(bert.validation[: 30 * 100], 32, bert.tokenizer)  # 100 blocks: 4 global batches of 24 an epoch
    reference, _ = take_global_batches(blocks, (1, 24), 24, 8, seed=5)

    def merged(ranks):
        return {k: torch.cat([rank[k] for rank in ranks]) for k in ranks[0]}

    for layout in ((2, 4), (3, 8), (3, 2)):
        steps, _ = take_global_batches(blocks, layout, 24, 8, seed=5)
        for got, expected in zip(steps, reference):
            got, expected = merged(got), merged(expected)
            assert torch.equal(got["input_ids"], expected["input_ids"]) and torch.equal(got["labels"], expected["labels"])
    # a block of epoch 0's first global batch is masked otherwise in epoch 1
    first, again = permutation(0, 100, 5)[:24], permutation(1, 100, 5)[:96]
    labels = [torch.cat([merged(ranks)["labels"] for ranks in reference[e * 4 : e * 4 + 4]]) for e in (0, 1)]
    both = [block for block in first if block in again]
    assert len(both) > 15
    assert sum(not torch.equal(labels[0][first.index(b)], labels[1][again.index(b)]) for b in both) >= len(both) - 1


def test_validation_batches_are_fixed_and_split_across_ranks():
    blocks = numbered_blocks(45)
    per_rank = [[b["input_ids"][:, 0].tolist() for b in validation_batches(blocks, 4, rank=r, world_size=2)] for r in range(2)]
    assert [len(p) for p in per_rank] == [5, 5]
    flat = [sum(p, []) for p in per_rank]
    assert flat[0] == list(range(20)) and flat[1] == list(range(22, 42))
    assert [b["input_ids"][:, 0].tolist() for b in validation_batches(blocks, 4, rank=1, world_size=2)] == per_rank[1]
    assert len(list(validation_batches(blocks, 4, max_batches=2))) == 2
    with pytest.raises(UserError, match="validation data has 45 blocks"):
        next(validation_batches(blocks, 16, world_size=4))


def test_mlm_validation_batches_do_not_depend_on_the_training_seed(cache_dir, bert):
    # Runs with different seeds must be scored on one validation set: the same masked tokens and
    # sentence pairs (seed-drawn masks once inflated BERT's seed-to-seed spread from 0.26% to 1.3%).
    from pathlib import Path

    from zoa_train.config import load_recipe
    from zoa_train.tasks import build_task

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"

    def batches(seed: int) -> list[dict]:
        # the vocabulary of the `bert` fixture, so its cached tokenizer and tokens are reused
        config = load_recipe(recipe, [f"train.seed={seed}", f"data.cache_dir={cache_dir}", "data.vocab_size=8192"])
        return list(build_task(config, rank=1, world_size=2).validation_batches(2))

    first, second = batches(0), batches(1)
    assert len(first) == 2 and not torch.equal(first[0]["labels"], first[1]["labels"])
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_too_little_data_for_the_batch_is_a_user_error():
    with pytest.raises(UserError, match="has 63 blocks, fewer than a global batch of 64"):
        DistributedBatchLoader(numbered_blocks(63), 16, world_size=4)


def test_prefetched_batches_and_their_position_are_those_of_the_loader():
    from zoa_train.data.prefetch import DevicePrefetcher

    blocks = numbered_blocks(103)

    def loader():
        return DistributedBatchLoader(blocks, 5, rank=1, world_size=2, seed=3)

    def to_device(batch, device):
        return {k: v.to(device) for k, v in batch.items()}

    plain = loader()
    reference = [next(plain)["input_ids"] for _ in range(25)]
    ahead = DevicePrefetcher(loader(), to_device, torch.device("cpu"))
    assert ahead.state_dict()["sample"] == 0  # nothing fetched yet
    got = [next(ahead)["input_ids"] for _ in range(13)]  # crosses the epoch end (10 batches per epoch)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    state = ahead.state_dict()  # after 13 batches, although the 14th is already fetched
    assert (state["epoch"], state["sample"], state["micro"]) == (1, 30, 0)
    resumed = DevicePrefetcher(loader(), to_device, torch.device("cpu"))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(next(resumed)["input_ids"], expected) for expected in reference[13:])


_TRAIN_TOKENIZER = """
import sys
from zoa_train.data import load_or_train_tokenizer
from zoa_train.data.sources import bundled_paragraphs
load_or_train_tokenizer(sys.argv[1], None, bundled_paragraphs(), 2048, sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_trained_tokenizer_numbers_its_tokens_alike_in_every_process(kind, tmp_path):
    """Two processes (each its own hash-map seed in the tokenizers library) train the same ids:
    the bert kind's WordPiece trainer alone would number ~100 tokens differently each time."""
    import subprocess
    import sys

    vocabs = []
    for attempt in ("a", "b"):
        subprocess.run([sys.executable, "-c", _TRAIN_TOKENIZER, kind, str(tmp_path / attempt)], check=True, timeout=300)
        vocabs.append(json.loads((tmp_path / attempt / "tokenizer.json").read_text())["model"]["vocab"])
    assert len(vocabs[0]) > 1000 and vocabs[0] == vocabs[1]
