"""`zoa-train eval wikitext` and `eval lambada` against direct computations, on files the tests write.

The scoring core is tested in-process on a tiny random GPT-2 and a tokenizer trained here in a
second; the commands end to end on a real 2-step gpt2_tiny run directory. Nothing is downloaded.
"""

import json
import math
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import refused, zoa, zoa_here

from zoa_train.evaluation.eval_texts import split_articles, split_documents, wikitext_detokenize
from zoa_train.evaluation.language import (
    Window,
    evaluate_lambada_texts,
    evaluate_wikitext,
    evaluate_wikitext_text,
    lambada_metrics,
    lambada_windows,
    plan_windows,
    score_windows,
    stream_windows,
)

ROOT = Path(__file__).resolve().parents[1]

# Two articles of WikiText's word-level form (as in wiki.test.tokens: a space at both ends of each line).
WIKI = " \n = Bennet = \n \n Mr. Bennet 's estate , 3 @,@ 000 acres . \n \n = Darcy = \n \n Darcy 's pride . \n"
# Counted by hand on WIKI as Megatron-LM counts (text.strip().split(" ")): 20 words and 6 line breaks.
WIKI_WORDS = 26
# As lm-evaluation-harness counts (re.split(r"\s+", article)) on the two articles: 13 + 7 words, and an
# empty string at each end of each article.
WIKI_LM_EVAL_WORDS = 15 + 9

LAMBADA = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife",
    "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that the experience of three-and-twenty years had been insufficient to make his wife understand his character",
    "She is tolerable, but not handsome enough to tempt me; I am in no humour at present to give consequence to young ladies who are slighted by other men. You had better return to your partner and enjoy her smiles, for you are wasting your time with me. Mr. Bingley followed his advice. Mr. Darcy walked off; and Elizabeth",
]

CORPUS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.",
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed.",
    "My dear Mr. Bennet, said his lady to him one day, have you heard that Netherfield Park is let at last?",
    "Mr. Bennet replied that he had not. But it is, returned she; for Mrs. Long has just been here, and she told me all about it.",
] * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A real byte-level BPE tokenizer (GPT-2's scheme), trained on a few sentences."""
    from zoa_train.data.tokenizer import load_or_train_tokenizer

    return load_or_train_tokenizer("gpt2", None, CORPUS, 300, tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def gpt2(tokenizer):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_layer=2, n_embd=32, n_head=2, eos_token_id=tokenizer.eos_token_id)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cache_dir) -> Path:
    """A real gpt2_tiny run directory after 2 training steps, trained by one rank in the command's own
    process (as under torchrun with one process: the cheapest, no rank is spawned)."""
    tmp = tmp_path_factory.mktemp("gpt2run")
    sets = [
        "train.steps=2",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
    ]
    one_rank = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp / "run"), *[a for s in sets for a in ("--set", s)], env=one_rank)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def loaded(run_dir):
    """The run's model and tokenizer loaded in this process, for direct computations."""
    from zoa_train.evaluation.checkpoints import load_language_model

    return load_language_model(run_dir)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    (root / "wiki.test.tokens").write_text(WIKI, encoding="utf-8")
    (root / "lambada_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA), encoding="utf-8")
    return {"wikitext": root / "wiki.test.tokens", "lambada": root / "lambada_test.jsonl"}


# --- Detokenizer ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokenized", "expected"),
    [
        ("the players ' union", "the players' union"),  # plural possessive
        ("a 3 @-@ year deal", "a 3-year deal"),
        ("1 @,@ 000 men", "1,000 men"),
        ("1 @.@ 5 miles", "1.5 miles"),
        ("first . Then", "first. Then"),
        ("first , then", "first, then"),
        ("as follows : one ; two", "as follows: one; two"),
        ("what ? no ! yes", "what? no! yes"),
        ("born ( in 1990 ) here", "born (in 1990) here"),
        ("see [ 1 ] and { x }", "see [1] and {x}"),
        ('he said " hello there " then', 'he said "hello there" then'),
        ("the ' Quiet ' One", "the 'Quiet' One"),
        (" = = Career = = ", " == Career == "),
        (" = = = Early life = = = ", " === Early life === "),
        (" = = = = Notes = = = = ", " ==== Notes ==== "),
        ("at 20 \N{DEGREE SIGN} C", "at 20\N{DEGREE SIGN}C"),
        ("end . \n Next", "end.\nNext"),
        ("the N cats", "the 1 cats"),
        ("Darcy 's letter", "Darcy's letter"),
        ("plain words stay", "plain words stay"),
    ],
)
def test_detokenizer_rules(tokenized, expected):
    assert wikitext_detokenize(tokenized) == expected


def test_articles_split_at_top_level_headings():
    articles = split_articles(WIKI)
    assert articles == [" \n = Bennet = \n \n Mr. Bennet 's estate , 3 @,@ 000 acres . \n \n", " = Darcy = \n \n Darcy 's pride . \n"]
    assert split_articles(" = = Only a section = = \n text \n") == [" = = Only a section = = \n text \n"]
    assert split_documents(WIKI, "headings") == articles


def test_lines_and_paragraphs_are_the_rows_of_the_datasets_text_loader(tmp_path):
    # What lm-evaluation-harness reads from a plain file with `dataset_path: text` (sample_by line or paragraph).
    import datasets

    text = "First line.\nSecond line,\nstill the second paragraph.\n\n\nThird, after two empty lines.\n\nLast, no line break"
    expected = {
        "line": ["First line.", "Second line,", "still the second paragraph.", "", "", "Third, after two empty lines.", "", "Last, no line break"],
        "paragraph": ["First line.\nSecond line,\nstill the second paragraph.", "\nThird, after two empty lines.", "Last, no line break"],
    }
    for ending in ("", "\n"):
        path = tmp_path / f"text{len(ending)}.txt"
        path.write_text(text + ending, encoding="utf-8")
        for sample_by, rule in (("line", "lines"), ("paragraph", "paragraphs")):
            rows = datasets.load_dataset("text", data_files=str(path), sample_by=sample_by, cache_dir=str(tmp_path / "cache"), split="train")["text"]
            pieces = expected[sample_by] if not ending or sample_by == "line" else [*expected[sample_by][:-1], expected[sample_by][-1] + ending]
            assert split_documents(text + ending, rule) == rows == pieces, (sample_by, ending)


# --- Windows ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "seq_len", "stride"), [(2, 8, 8), (9, 8, 8), (10, 8, 8), (50, 8, 3), (50, 8, 1), (51, 8, 8), (23, 16, 5)])
def test_windows_score_every_token_after_the_first_once(n, seq_len, stride):
    windows = plan_windows(n, seq_len, stride)
    scored = [p for start, end, k in windows for p in range(end - k, end)]
    assert scored == list(range(1, n))
    assert all(end - start <= seq_len + 1 and 1 <= k <= end - start - 1 for start, end, k in windows)
    assert all(k <= stride and end - start == seq_len + 1 for start, end, k in windows[1:])  # later windows: full context


def test_ranks_share_every_window_once():
    from zoa_train.distributed import EvaluationRanks

    items = list(range(11))
    for world in (1, 2, 3, 4):
        shares = [EvaluationRanks(torch.device("cpu"), rank, world).share(items) for rank in range(world)]
        assert [i for share in shares for i in share] == items and max(map(len, shares)) - min(map(len, shares)) <= 1


def direct_nll(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """Each scored token's NLL from its own forward pass over exactly its context: token p <= seq_len sees
    tokens 0..p-1; a later token belongs to the window ending at the first seq_len + 1 + k * stride > p
    (or at the text's end), whose input starts seq_len + 1 tokens before that end."""
    n, total = len(ids), 0.0
    with torch.no_grad():
        for p in range(1, n):
            if p <= seq_len:
                start = 0
            else:
                end = min(n, seq_len + 1 + math.ceil((p + 1 - (seq_len + 1)) / stride) * stride)
                start = end - seq_len - 1
            logits = model(ids[start:p][None]).logits[0, -1]
            total -= torch.log_softmax(logits.double(), dim=-1)[ids[p]].item()
    return total, n - 1


def test_non_overlapping_windows_equal_the_full_sequence_loss_when_the_text_fits(gpt2):
    generator = torch.Generator().manual_seed(1)
    for n in (33, 20):  # seq_len + 1 tokens: exactly one window; fewer: one shorter window
        ids = torch.randint(len_vocab(gpt2), (n,), generator=generator)
        sums = score_windows(gpt2, stream_windows(ids, 32, 32), batch_size=4)
        with torch.no_grad():
            loss = gpt2(ids[None], labels=ids[None]).loss.item()
        assert sums.windows == 1 and sums.tokens == n - 1
        assert sums.nll / sums.tokens == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize(("seq_len", "stride", "batch_size"), [(16, 5, 3), (16, 16, 2), (12, 1, 16)])
def test_overlapping_windows_equal_a_direct_computation(gpt2, seq_len, stride, batch_size):
    ids = torch.randint(len_vocab(gpt2), (41,), generator=torch.Generator().manual_seed(2))
    sums = score_windows(gpt2, stream_windows(ids, seq_len, stride), batch_size=batch_size)
    expected, count = direct_nll(gpt2, ids, seq_len, stride)
    assert sums.tokens == count
    assert sums.nll == pytest.approx(expected, rel=1e-5)
    # Not the same as scoring with less context: the test would notice windows that forget it.
    if stride < seq_len:
        shorter, _ = direct_nll(gpt2, ids, stride, stride)
        assert abs(shorter - expected) > 1e-3


def len_vocab(model) -> int:
    return model.config.vocab_size


def test_wikitext_adjusted_perplexity_uses_words_minus_one_counted_on_the_original_text(gpt2, tokenizer):
    result = evaluate_wikitext_text(gpt2, tokenizer, WIKI, seq_len=16, stride=4, batch_size=3)
    assert result["words"] == WIKI_WORDS and len(wikitext_detokenize(WIKI).strip().split(" ")) != WIKI_WORDS
    assert result["adjusted_perplexity"] == pytest.approx(math.exp(result["nll"] / (WIKI_WORDS - 1)), rel=1e-12)
    assert result["scored_tokens"] == result["tokens"] - 1
    assert result["token_perplexity"] == pytest.approx(math.exp(result["nll"] / result["scored_tokens"]), rel=1e-12)
    ids = torch.tensor(tokenizer(wikitext_detokenize(WIKI), add_special_tokens=False)["input_ids"])
    assert result["tokens"] == len(ids)
    assert result["nll"] == pytest.approx(direct_nll(gpt2, ids, 16, 4)[0], rel=1e-5)

    # lm-evaluation-harness's convention: per article, an end-of-text token first (so every token is scored),
    # non-overlapping windows; words and bytes of the original text.
    lm = result["lm_eval"]
    assert lm["words"] == WIKI_LM_EVAL_WORDS and lm["bytes"] == len(WIKI.encode()) and lm["documents"] == 2
    direct = 0.0
    for article in split_articles(WIKI):
        tokens = torch.tensor([tokenizer.eos_token_id, *tokenizer(wikitext_detokenize(article), add_special_tokens=False)["input_ids"]])
        direct += direct_nll(gpt2, tokens, 16, 16)[0]
    assert lm["nll"] == pytest.approx(direct, rel=1e-5)
    assert lm["word_perplexity"] == pytest.approx(math.exp(direct / WIKI_LM_EVAL_WORDS), rel=1e-5)
    assert lm["bits_per_byte"] == pytest.approx(direct / len(WIKI.encode()) / math.log(2), rel=1e-5)


def test_line_documents_are_scored_alone_and_counted_without_their_line_breaks(gpt2, tokenizer):
    text = "".join(line + "\n" for line in CORPUS[:4])
    lines = split_documents(text, "lines")
    result = evaluate_wikitext_text(gpt2, tokenizer, text, seq_len=16, stride=16, detokenize=False, documents=lines)
    lm = result["lm_eval"]
    direct = 0.0
    for line in lines:  # each line's first token after end-of-text; no line break scored
        tokens = torch.tensor([tokenizer.eos_token_id, *tokenizer(line, add_special_tokens=False)["input_ids"]])
        direct += direct_nll(gpt2, tokens, 16, 16)[0]
    assert lm["documents"] == 4 and lm["bytes"] == len(text.encode()) - 4 and lm["words"] == sum(len(line.split()) for line in lines)
    assert lm["nll"] == pytest.approx(direct, rel=1e-5)
    # The whole text as one document (the headings rule on a text without headings) scores another sum.
    whole = evaluate_wikitext_text(gpt2, tokenizer, text, seq_len=16, stride=16, detokenize=False)["lm_eval"]
    assert whole["documents"] == 1 and whole["words"] == lm["words"] + 1 and abs(whole["nll"] - lm["nll"]) > 1.0


# --- LAMBADA -----------------------------------------------------------------------------------------
class Bigram(torch.nn.Module):
    """Logits the test designs: row `table[token]` predicts the token after `token`; forward(input_ids) only."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


def test_lambada_is_strict_about_every_token_of_the_last_word(tokenizer):
    context, word = "They sailed away to", " Zembla"
    before = tokenizer(context, add_special_tokens=False)["input_ids"]
    target = tokenizer(context + word, add_special_tokens=False)["input_ids"][len(before) :]
    chain = [before[-1], *target]  # each token predicts the next
    assert len(target) >= 3 and len(set(chain)) == len(chain), chain
    vocab = len(tokenizer)
    wrong = next(t for t in range(vocab) if t not in chain)

    def model(miss: int | None) -> Bigram:
        table = torch.zeros(vocab, vocab)
        for i, (prev, nxt) in enumerate(zip(chain, chain[1:])):
            table[prev, nxt] = 6.0
            if i == miss:
                table[prev, wrong] = 7.0  # the argmax, though the right token stays likely
        return Bigram(table)

    texts = [context + word]
    assert evaluate_lambada_texts(model(None), tokenizer, texts)["accuracy"] == 1.0
    for miss in (0, len(target) - 1):  # the first or only the last token of the word not the argmax
        assert evaluate_lambada_texts(model(miss), tokenizer, texts)["accuracy"] == 0.0

    # Two examples, one right and one wrong, with the perplexities from the designed rows.
    short = "They sailed away"  # its last word " away" is predicted by the row of " sailed": wrong
    good = model(None)
    result = evaluate_lambada_texts(good, tokenizer, [context + word, short], batch_size=2)
    assert result["examples"] == 2 and result["correct"] == 1 and result["accuracy"] == 0.5
    rows = torch.log_softmax(good.table.detach().double(), dim=-1)
    first = -sum(rows[p, n].item() for p, n in zip(chain, chain[1:]))
    short_before = tokenizer("They sailed", add_special_tokens=False)["input_ids"]
    short_chain = [short_before[-1], *tokenizer(short, add_special_tokens=False)["input_ids"][len(short_before) :]]
    second = -sum(rows[p, n].item() for p, n in zip(short_chain, short_chain[1:]))
    tokens = len(chain) - 1 + len(short_chain) - 1
    assert result["target_tokens"] == tokens
    assert result["target_perplexity"] == pytest.approx(math.exp((first + second) / tokens), rel=1e-5)
    assert result["lm_eval_perplexity"] == pytest.approx(math.exp((first + second) / 2), rel=1e-5)


def test_lambada_contexts_are_cut_from_the_left(tokenizer):
    windows, cut = lambada_windows(tokenizer, LAMBADA, max_len=8)
    assert cut == 3 and all(len(w.tokens) == 9 for w in windows)
    whole = tokenizer(LAMBADA[0], add_special_tokens=False)["input_ids"]
    assert windows[0].tokens.tolist() == whole[-9:]
    windows, cut = lambada_windows(tokenizer, LAMBADA)
    assert cut == 0 and [len(w.tokens) for w in windows] == [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in LAMBADA]
    assert isinstance(windows[0], Window)


# --- The commands end to end -------------------------------------------------------------------------
@pytest.mark.slow  # run_dir trains
def test_eval_wikitext_end_to_end(run_dir, loaded, data_files, tmp_path):
    out = tmp_path / "wikitext.json"
    done = zoa(
        "eval",
        "wikitext",
        "--checkpoint",
        str(run_dir),
        "--data",
        str(data_files["wikitext"]),
        "--seq-len",
        "16",
        "--stride",
        "4",
        "--batch-size",
        "3",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "adjusted perplexity" in done.stdout and "word_perplexity" in done.stdout and "bits_per_byte" in done.stdout
    result = json.loads(out.read_text())
    assert result["protocol"].startswith("WikiText-103") and "lm-evaluation-harness" in result["lm_eval_protocol"]
    assert result["checkpoint"].endswith("step_00000002/model.pt") and result["step"] == 2
    assert (result["seq_len"], result["stride"], result["words"], result["lm_eval"]["words"]) == (16, 4, WIKI_WORDS, WIKI_LM_EVAL_WORDS)
    assert result["data"] == str(data_files["wikitext"]) and result["detokenized"] is True
    assert result["document_rule"] == "headings" and result["lm_eval"]["documents"] == 2 and result["text_field"] is None

    expected = evaluate_wikitext_text(loaded.model, loaded.tokenizer, WIKI, 16, 4)
    for key in ("tokens", "scored_tokens", "windows"):
        assert result[key] == expected[key]
    for key in ("token_perplexity", "adjusted_perplexity"):
        assert result[key] == pytest.approx(expected[key], rel=1e-5)
    for key in ("word_perplexity", "bits_per_byte"):
        assert result["lm_eval"][key] == pytest.approx(expected["lm_eval"][key], rel=1e-5)

    # --seq-len beyond the model's positions is capped (the stride with it); --raw skips detokenization.
    capped = evaluate_wikitext(run_dir, str(data_files["wikitext"]), 100_000, 100_000, 8, detokenize=False)
    assert capped["seq_len"] == capped["n_positions"] == capped["stride"] == 1024 and capped["windows"] == 1
    assert capped["detokenized"] is False and capped["words"] == len(WIKI.split())
    assert capped["document_rule"] == "lines" and capped["lm_eval"]["documents"] == WIKI.count("\n")  # --raw's default

    # JSON lines: the documents of a field, the sliding-window pass over them joined (each ending a line).
    pages = data_files["wikitext"].with_name("pages.jsonl")
    pages.write_text("".join(json.dumps({"page": a}) + "\n" for a in split_articles(WIKI)), encoding="utf-8")
    jsonl = evaluate_wikitext(run_dir, str(pages), 16, 4, 3, documents="jsonl", text_field="page")
    assert (jsonl["document_rule"], jsonl["text_field"], jsonl["tokens"], jsonl["windows"]) == ("jsonl", "page", result["tokens"], result["windows"])
    for key in ("word_perplexity", "bits_per_byte"):
        assert jsonl["lm_eval"][key] == pytest.approx(result["lm_eval"][key], rel=1e-5)


@pytest.mark.slow
def test_eval_lambada_end_to_end(run_dir, loaded, data_files, tmp_path, capsys):
    # Through the console entry point in this process (the wikitext test above starts a fresh one).
    out = tmp_path / "lambada.json"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    done = zoa_here(
        capsys,
        "eval",
        "lambada",
        "--checkpoint",
        str(checkpoint),
        "--data",
        str(data_files["lambada"]),
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "accuracy" in done.stdout and "perplexity" in done.stdout
    result = json.loads(out.read_text())
    assert result["protocol"].startswith("LAMBADA") and result["checkpoint"] == str(checkpoint / "model.pt") and result["step"] == 2
    lengths = [len(loaded.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in LAMBADA]
    assert result["examples"] == 3 and result["seq_len"] == 32 and result["contexts_cut"] == sum(n > 33 for n in lengths) >= 1
    expected = lambada_metrics(score_windows(loaded.model, lambada_windows(loaded.tokenizer, LAMBADA, 32)[0]))
    assert result["correct"] == expected["correct"] and result["target_tokens"] == expected["target_tokens"] >= 3
    assert result["target_perplexity"] == pytest.approx(expected["target_perplexity"], rel=1e-5)
    assert result["lm_eval_perplexity"] == pytest.approx(expected["lm_eval_perplexity"], rel=1e-5)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny BERT saved as a Hugging Face directory: the cheapest model of the wrong family."""
    import transformers

    path = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=32
    )
    transformers.BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_bad_input_is_one_sentence_and_exit_code_2(run_dir, data_files, bert_dir, tmp_path, capsys):
    bad_lines = tmp_path / "bad.jsonl"
    bad_lines.write_text('{"text": "a fine example"}\n{"sentence": "no text field here"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    blank_texts = tmp_path / "blank.jsonl"
    blank_texts.write_text('{"text": ""}\n{"text": " "}\n')
    wikitext, lambada = str(data_files["wikitext"]), str(data_files["lambada"])
    jsonl = ["wikitext", "--checkpoint", str(run_dir), "--raw", "--documents", "jsonl", "--data"]
    cases = {
        "missing wikitext file": (["wikitext", "--checkpoint", str(run_dir), "--data", str(tmp_path / "wiki.test.tokens")], "does not exist"),
        "missing lambada file": (["lambada", "--checkpoint", str(run_dir), "--data", str(tmp_path / "nope.jsonl")], "does not exist"),
        "no text field": (["lambada", "--checkpoint", str(run_dir), "--data", str(bad_lines)], "line 2 of"),
        "BERT for wikitext": (
            ["wikitext", "--checkpoint", str(bert_dir), "--data", wikitext],
            "holds a BERT model; this evaluation needs a GPT-2, Llama or Hugging Face causal LM model",
        ),
        "BERT for lambada": (
            ["lambada", "--checkpoint", str(bert_dir), "--data", lambada],
            "holds a BERT model; this evaluation needs a GPT-2, Llama or Hugging Face causal LM model",
        ),
        "missing checkpoint": (["lambada", "--checkpoint", str(tmp_path / "none"), "--data", lambada], "no such file or directory"),
        "zero stride": (["wikitext", "--checkpoint", str(run_dir), "--data", wikitext, "--stride", "0"], "--stride"),
        "unknown document rule": (["wikitext", "--checkpoint", str(run_dir), "--data", wikitext, "--documents", "pages"], "--documents must be one of"),
        "text field without jsonl": (["wikitext", "--checkpoint", str(run_dir), "--data", wikitext, "--text-field", "page"], "--text-field names"),
        "jsonl without the field": ([*jsonl, lambada, "--text-field", "page"], "line 1 of " + lambada + ' is not a JSON object with a "page" string'),
        "jsonl of no lines": ([*jsonl, str(empty)], "holds no JSON lines"),
        "jsonl of no text": ([*jsonl, str(blank_texts)], 'holds no text in its "text" fields'),
        "jsonl from the hub": ([*jsonl, "hub"], "--documents jsonl reads a local JSON-lines file"),
        "wikitext not text": (
            ["wikitext", "--checkpoint", str(run_dir), "--data", str(ROOT / "zoa_train" / "data" / "corpus" / "austen.txt.xz"), "--raw"],
            "is not UTF-8 text",
        ),
    }
    for args, message in cases.values():
        refused(zoa_here(capsys, "eval", *args), message)
