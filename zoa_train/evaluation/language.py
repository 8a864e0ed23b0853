"""`zoa-train eval wikitext` and `zoa-train eval lambada`: zero-shot evaluation of causal LMs
(GPT-2, Llama: the families whose registry entry lists them, zoa_train/models/registry.py).

WikiText-103 (the protocol of Megatron-LM's and the GPT-2 paper's zero-shot evaluation)
  The test file as distributed (`wiki.test.tokens`: word-level, space-separated, `@-@` for hyphens)
  is detokenized as a whole (`wikitext_detokenize`), tokenized with the model's tokenizer, and scored
  with overlapping windows: a window holds at most `seq_len` input tokens and predicts the token
  after each of them; the first window scores all its predictions (every token but the very first,
  which has no context), each later window moves `stride` tokens on and scores only its last
  `stride` predictions, so every token after the first is scored exactly once, with at least
  `seq_len - stride` tokens of context. `stride == seq_len` gives non-overlapping windows.
  Reported: token perplexity exp(NLL / scored tokens) and the adjusted (word-level) perplexity
  exp(NLL / (words - 1)), words counted on the original word-level text as Megatron-LM does
  (`text.strip().split(" ")`: the words plus one per line break, the <eos> of WikiText's word-level
  count), so that models with different tokenizers compare on one scale.

  For comparison with lm-evaluation-harness's `wikitext` task, a second pass follows its
  conventions: the text cut into documents (`--documents`: WikiText articles, split at top-level
  ` = Title = ` headings, as lm-eval's wikitext data has them; lines or paragraphs, as its `text`
  loader reads a plain file; or JSON lines' text field), each detokenized (unless raw) and
  tokenized alone, an end-of-text token before its first token (so every token is scored, and
  nothing between documents), non-overlapping windows of `seq_len` predictions (its
  `loglikelihood_rolling`); word_perplexity exp(NLL / words) with words as
  `re.split(r"\\s+", document)` counts them on each original document, byte_perplexity
  exp(NLL / bytes) and bits_per_byte NLL / bytes / ln 2, bytes of the original UTF-8 documents.

LAMBADA (OpenAI's version, as lm-evaluation-harness's `lambada_openai`)
  JSON lines with a `text` field; the target is " " + the last word (all its tokens: the tokens of
  context + target after those of the context alone), the context everything before it. An example
  is correct only when every target token is the model's argmax prediction. Reported: accuracy, the
  target tokens' perplexity exp(NLL / target tokens) and lm-evaluation-harness's `perplexity`,
  exp(-mean over examples of the example's target log-likelihood).

Scoring is model-agnostic (`score_windows`: any module whose `forward(input_ids)` returns an object
with `.logits`), batched, under `torch.no_grad`. Under torchrun or srun the windows (examples) are
split over the ranks and the sums added with one allreduce; rank 0 reports. The texts, as each protocol
reads and cuts them: eval_texts.py.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zoa_train.errors import UserError
from zoa_train.evaluation.eval_texts import (
    DOCUMENT_RULES,
    HUB,
    lm_eval_word_count,
    megatron_word_count,
    read_lambada,
    read_wikitext,
    split_documents,
    split_last_word,
    wikitext_detokenize,
)

if TYPE_CHECKING:  # torch and transformers take seconds to import: only inside the commands
    import torch


# --- Windows and scoring -----------------------------------------------------------------------
@dataclass
class Window:
    """`tokens[:-1]` are the model's input, `tokens[1:]` the targets; the last `scored` targets are scored."""

    tokens: "torch.Tensor"  # 1-D int64, at most seq_len + 1 tokens
    scored: int


@dataclass
class Sums:
    """What a set of windows adds up to: everything a metric needs, and what ranks allreduce."""

    nll: float = 0.0  # summed negative log-likelihood of the scored tokens, in nats
    tokens: int = 0  # scored tokens
    correct: int = 0  # windows whose scored tokens were all the argmax prediction
    windows: int = 0

    def as_list(self) -> list[float]:
        return [self.nll, float(self.tokens), float(self.correct), float(self.windows)]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> "Sums":
        return cls(float(values[0]), round(values[1]), round(values[2]), round(values[3]))


def plan_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """The sliding windows over a stream of `n_tokens` tokens, as (start, end, scored): the window is
    tokens[start:end] (at most seq_len + 1 tokens: seq_len inputs and the token after the last) and
    it scores its last `scored` targets. Every token but the first is scored exactly once."""
    if seq_len < 1 or not 1 <= stride <= seq_len:
        raise ValueError(f"need seq_len >= 1 and 1 <= stride <= seq_len, not seq_len={seq_len}, stride={stride}")
    windows, done = [], 1  # tokens before `done` are scored already (token 0 never is)
    while done < n_tokens:
        end = min(n_tokens, done + stride if windows else seq_len + 1)
        start = max(0, end - seq_len - 1)
        windows.append((start, end, end - done))
        done = end
    return windows


def stream_windows(token_ids: "torch.Tensor", seq_len: int, stride: int) -> list[Window]:
    """`plan_windows` over a 1-D token tensor (the windows are views, nothing is copied)."""
    return [Window(token_ids[start:end], scored) for start, end, scored in plan_windows(len(token_ids), seq_len, stride)]


def model_context(model) -> int | None:
    """The longest input the model takes (GPT-2's n_positions), None when it does not say."""
    config = getattr(model, "config", None)
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def score_windows(
    model,
    windows: Sequence[Window],
    batch_size: int = 8,
    device=None,
    pad_id: int = 0,
    advance: Callable[[int], None] = lambda n: None,
) -> Sums:
    """Score `windows` with `model` (any module whose forward(input_ids) returns an object with .logits),
    `batch_size` windows per forward pass, longest first, right-padded with `pad_id` (a causal model's
    earlier positions never see the padding). `advance(n)` is called after each batch of n windows."""
    import torch

    device = device or next(model.parameters(), torch.empty(0)).device
    keeps_logits = _accepts_logits_to_keep(model)
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].tokens))
    total_nll, total = torch.zeros((), dtype=torch.float64), Sums()
    with torch.no_grad():
        for first in range(0, len(order), batch_size):
            batch = [windows[i] for i in order[first : first + batch_size]]
            width = max(len(w.tokens) for w in batch) - 1  # input positions
            inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
            targets = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.bool)
            for row, w in enumerate(batch):
                n = len(w.tokens) - 1
                if not 1 <= w.scored <= n:
                    raise ValueError(f"a window of {n + 1} tokens cannot score {w.scored}")
                inputs[row, :n] = w.tokens[:-1]
                targets[row, :n] = w.tokens[1:]
                mask[row, n - w.scored : n] = True
            keep = width - int(mask.float().argmax(dim=1).min())  # the positions from the first scored one on
            inputs = inputs.to(device)
            if keeps_logits:
                logits = model(input_ids=inputs, logits_to_keep=keep, use_cache=False).logits
            else:
                logits = model(inputs).logits
            logits = logits[:, -keep:].float()
            targets, mask = targets[:, -keep:].to(device), mask[:, -keep:].to(device)
            log_probs = torch.log_softmax(logits, dim=-1)
            nll = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            greedy = (logits.argmax(dim=-1) == targets) | ~mask
            total_nll += nll[mask].double().sum().cpu()
            total.tokens += int(mask.sum())
            total.correct += int(greedy.all(dim=1).sum())
            total.windows += len(batch)
            advance(len(batch))
    total.nll = float(total_nll)
    return total


def _accepts_logits_to_keep(model) -> bool:
    """Whether forward takes `logits_to_keep` (transformers' causal LMs): then only the scored positions' logits are computed."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def encode(tokenizer, text: str) -> "torch.Tensor":
    """`text`'s token ids, no special tokens added, as a 1-D int64 tensor."""
    import torch

    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


# --- WikiText --------------------------------------------------------------------------------------
def wikitext_windows(
    tokenizer, original: str, documents: Sequence[str], seq_len: int, stride: int, detokenize: bool = True
) -> tuple[list[Window], list[Window], dict]:
    """The sliding windows of the paper's protocol over `original`, the windows of lm-evaluation-harness's
    convention over `documents`, and the counts both need (see the module's docstring)."""
    import torch

    tokens = encode(tokenizer, wikitext_detokenize(original) if detokenize else original)
    if len(tokens) < 2:
        raise UserError("the text has fewer than 2 tokens; a perplexity needs at least one token after the first.")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the model's tokenizer has no end-of-text token, which a causal LM's evaluation needs.")
    lm_eval = []
    for document in documents:  # each alone: its first token after end-of-text, nothing between documents scored
        ids = encode(tokenizer, wikitext_detokenize(document) if detokenize else document)
        lm_eval += stream_windows(torch.cat([torch.tensor([eos]), ids]), seq_len, seq_len)
    counts = {
        "tokens": len(tokens),
        "words": megatron_word_count(original) if detokenize else len(original.split()),
        "documents": len(documents),
        "lm_eval_words": sum(lm_eval_word_count(d) for d in documents),
        "lm_eval_bytes": sum(len(d.encode("utf-8")) for d in documents),
    }
    return stream_windows(tokens, seq_len, stride), lm_eval, counts


def wikitext_metrics(paper: Sums, lm_eval: Sums, counts: dict) -> dict:
    """The reported numbers from the two passes' sums and the text's counts."""
    words, lm_words, n_bytes = counts["words"], counts["lm_eval_words"], counts["lm_eval_bytes"]
    return {
        "token_perplexity": _exp(paper.nll / paper.tokens),
        "adjusted_perplexity": _exp(paper.nll / (words - 1)) if words > 1 else math.inf,
        "nll": paper.nll,
        "scored_tokens": paper.tokens,
        "windows": paper.windows,
        "lm_eval": {
            "word_perplexity": _exp(lm_eval.nll / lm_words),
            "byte_perplexity": _exp(lm_eval.nll / n_bytes),
            "bits_per_byte": lm_eval.nll / n_bytes / math.log(2),
            "nll": lm_eval.nll,
            "scored_tokens": lm_eval.tokens,
            "windows": lm_eval.windows,
            "words": lm_words,
            "bytes": n_bytes,
            "documents": counts["documents"],
        },
    }


def evaluate_wikitext_text(
    model,
    tokenizer,
    original: str,
    seq_len: int,
    stride: int,
    batch_size: int = 8,
    detokenize: bool = True,
    device=None,
    documents: Sequence[str] | None = None,
) -> dict:
    """Both passes over `original` in this process (no ranks, no progress): the testable core of `eval wikitext`;
    `documents` default to `original`'s WikiText articles."""
    documents = split_documents(original, "headings") if documents is None else documents
    paper, lm_eval, counts = wikitext_windows(tokenizer, original, documents, seq_len, stride, detokenize)
    pad = tokenizer.eos_token_id or 0
    result = wikitext_metrics(score_windows(model, paper, batch_size, device, pad), score_windows(model, lm_eval, batch_size, device, pad), counts)
    return {**counts, **result}


# --- LAMBADA -----------------------------------------------------------------------------------------


def lambada_windows(tokenizer, texts: Sequence[str], max_len: int | None = None) -> tuple[list[Window], int]:
    """One window per example: context + target, cut from the left to `max_len` inputs, scoring the
    target's tokens (those of context + target after the context's own, as lm-evaluation-harness does);
    and how many contexts were cut."""
    import torch

    pairs = [split_last_word(t) for t in texts]
    contexts = tokenizer([c for c, _ in pairs], add_special_tokens=False, verbose=False)["input_ids"]
    wholes = tokenizer([c + w for c, w in pairs], add_special_tokens=False, verbose=False)["input_ids"]
    windows, cut = [], 0
    for context, whole in zip(contexts, wholes):
        target = len(whole) - len(context)
        if target < 1 or not context:
            raise UserError("an example's last word or its context encodes to no tokens; each text needs words before its last word.")
        tokens = whole[-(max_len + 1) :] if max_len else whole
        cut += len(tokens) < len(whole)
        windows.append(Window(torch.tensor(tokens, dtype=torch.long), min(target, len(tokens) - 1)))
    return windows, cut


def lambada_metrics(sums: Sums) -> dict:
    return {
        "examples": sums.windows,
        "correct": sums.correct,
        "accuracy": sums.correct / sums.windows,
        "target_tokens": sums.tokens,
        "target_perplexity": _exp(sums.nll / sums.tokens),
        "lm_eval_perplexity": _exp(sums.nll / sums.windows),
        "nll": sums.nll,
    }


def evaluate_lambada_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 8, device=None) -> dict:
    """Strict last-word accuracy and perplexities over `texts` in this process: the testable core of `eval lambada`."""
    windows, _ = lambada_windows(tokenizer, texts, model_context(model))
    return lambada_metrics(score_windows(model, windows, batch_size, device, tokenizer.eos_token_id or 0))


# --- Ranks and progress ----------------------------------------------------------------------------
def _add_over_ranks(sums: list[Sums], ranks) -> list[Sums]:
    """The ranks' sums added (one allreduce)."""
    if ranks.world == 1:
        return sums
    import torch
    import torch.distributed as dist

    flat = torch.tensor([v for s in sums for v in s.as_list()], dtype=torch.float64, device=ranks.device)
    dist.all_reduce(flat)
    values = flat.cpu().tolist()
    return [Sums.from_list(values[4 * i : 4 * i + 4]) for i in range(len(sums))]


def _score_with_progress(model, passes: list[tuple[str, list[Window]]], batch_size: int, ranks, pad_id: int) -> list[Sums]:
    """Each pass's windows scored (this rank's share), with a progress bar on rank 0's terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from zoa_train import console as zoa_console

    console = zoa_console.err
    shares = [(label, ranks.share(windows)) for label, windows in passes]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=ranks.rank != 0 or not console.is_terminal) as progress:
        sums = []
        for label, windows in shares:
            task = progress.add_task(label, total=len(windows))
            sums.append(score_windows(model, windows, batch_size, ranks.device, pad_id, lambda n, t=task: progress.advance(t, n)))
    return _add_over_ranks(sums, ranks)


def _load(checkpoint: Path, evaluation: str):
    import transformers

    from zoa_train.evaluation.checkpoints import load_language_model

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars: the commands show their own progress
    return load_language_model(checkpoint, evaluation)


def _described(loaded, source: str) -> dict:
    """The fields every evaluation result starts with: what was scored, on what."""
    return {"checkpoint": loaded.source, "step": loaded.step, "averaged_ranks": loaded.averaged_ranks, "data": source}


def _number(x: float) -> str:
    return f"{x:,.3f}" if math.isfinite(x) else "inf"


# --- Commands (registered on `zoa-train eval` in zoa_train/cli.py) -------------------------------
CHECKPOINT_HELP = (
    "A run directory (its latest complete checkpoint), a checkpoint directory, a model file or a Hugging Face directory of a causal LM (GPT-2, Llama)."
)


def evaluate_wikitext(
    checkpoint: Path,
    data: str,
    seq_len: int,
    stride: int,
    batch_size: int,
    detokenize: bool = True,
    documents: str | None = None,
    text_field: str | None = None,
) -> dict | None:
    """`eval wikitext`'s result as a dict on rank 0 (None on the other ranks); `documents` None: headings,
    or lines for raw text (`detokenize` False)."""
    if seq_len < 2 or stride < 1 or batch_size < 1:
        raise UserError("--seq-len must be at least 2, and --stride and --batch-size at least 1.")
    rule = documents or ("headings" if detokenize else "lines")
    if rule not in DOCUMENT_RULES:
        raise UserError(f"--documents must be one of {', '.join(DOCUMENT_RULES)}, not {rule!r}.")
    if text_field is not None and rule != "jsonl":
        raise UserError(f"--text-field names the JSON field of --documents jsonl; --documents {rule} reads plain text.")
    started = time.perf_counter()
    original, document_texts, source = read_wikitext(data, rule, text_field or "text")
    loaded = _load(checkpoint, "wikitext")
    n_positions = model_context(loaded.model)
    used_seq_len = min(seq_len, n_positions) if n_positions else seq_len
    used_stride = min(stride, used_seq_len)
    paper, lm_eval, counts = wikitext_windows(loaded.tokenizer, original, document_texts, used_seq_len, used_stride, detokenize)
    from zoa_train.distributed import evaluation_ranks

    with evaluation_ranks() as ranks:
        loaded.model.to(ranks.device)
        paper_sums, lm_eval_sums = _score_with_progress(
            loaded.model, [("sliding windows", paper), ("lm-eval windows", lm_eval)], batch_size, ranks, loaded.tokenizer.eos_token_id or 0
        )
        if ranks.rank != 0:
            return None
        world = ranks.world
    return {
        "protocol": "WikiText-103 zero-shot perplexity, overlapping windows (Megatron-LM / GPT-2 protocol)",
        "lm_eval_protocol": f"lm-evaluation-harness wikitext (loglikelihood_rolling): {DOCUMENT_RULES[rule]}, each alone after an end-of-text token, non-overlapping windows",
        **_described(loaded, source),
        "detokenized": detokenize,
        "document_rule": rule,
        "text_field": (text_field or "text") if rule == "jsonl" else None,
        "seq_len": used_seq_len,
        "stride": used_stride,
        "requested_seq_len": seq_len,
        "requested_stride": stride,
        "n_positions": n_positions,
        **counts,
        **wikitext_metrics(paper_sums, lm_eval_sums, counts),
        "ranks": world,
        "seconds": time.perf_counter() - started,
    }


def wikitext_command(
    checkpoint: Annotated[Path, typer.Option(help=CHECKPOINT_HELP, show_default=False)],
    data: Annotated[
        str,
        typer.Option(
            help="WikiText-103's word-level test file (wiki.test.tokens as distributed), with --raw any UTF-8 text, with --documents jsonl JSON lines; or 'hub' for the hub's wikitext-103-raw-v1 test split (online). [default: hub]",
            show_default=False,
        ),
    ] = HUB,
    seq_len: Annotated[int, typer.Option(help="Tokens of input per window, at most the model's n_positions. [default: 1024]", show_default=False)] = 1024,
    stride: Annotated[
        int,
        typer.Option(
            help="Tokens each window moves on and scores after the first; --stride equal to --seq-len: non-overlapping windows. [default: 32]",
            show_default=False,
        ),
    ] = 32,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass. [default: 8]", show_default=False)] = 8,
    raw: Annotated[
        bool, typer.Option("--raw", help="The file is ordinary text: no WikiText detokenization, words are its whitespace-separated words.")
    ] = False,
    documents: Annotated[
        str | None,
        typer.Option(
            help="What a document is for the lm-eval pass, which scores each alone (its first token after end-of-text, nothing between documents): "
            "headings (a new one at each top-level ' = Title = ' line: WikiText's articles, as lm-eval's wikitext task has them), "
            "lines (each line, empty ones too: what lm-eval reads from a plain file with dataset_path text), "
            "paragraphs (the pieces between empty lines: dataset_path text, sample_by paragraph), "
            "jsonl (each JSON line's --text-field: dataset_path json). [default: headings; with --raw: lines]",
            show_default=False,
        ),
    ] = None,
    text_field: Annotated[
        str | None,
        typer.Option(help="The field holding each document with --documents jsonl (lm-eval's wikitext data: page). [default: text]", show_default=False),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.", show_default=False)] = None,
) -> None:
    """Zero-shot WikiText-103 perplexity of a causal LM (GPT-2, Llama): token and adjusted (word-level) perplexity with overlapping windows, and lm-evaluation-harness's word_perplexity and bits_per_byte; split over the ranks under torchrun or srun."""
    from rich.table import Table

    from zoa_train import console as zoa_console
    from zoa_train.files import check_output_file, write_json_file

    if json_out is not None:
        check_output_file(json_out, "--json")  # before the evaluation: its result must have somewhere to go
    result = evaluate_wikitext(checkpoint, data, seq_len, stride, batch_size, detokenize=not raw, documents=documents, text_field=text_field)
    if result is None:
        return
    if json_out is not None:
        write_json_file(json_out, result, "--json")
    lm = result["lm_eval"]
    step = f" step {result['step']}" if result["step"] is not None else ""
    table = Table(title=f"WikiText{' (raw text)' if raw else ''}: {result['checkpoint']}{step} on {result['data']}")
    for name in ("protocol", "metric", "value"):
        table.add_column(name, justify="left" if name != "value" else "right")
    windows = f"seq_len {result['seq_len']}, stride {result['stride']}"
    table.add_row(f"sliding windows ({windows})", "token perplexity", _number(result["token_perplexity"]))
    table.add_row("", f"adjusted perplexity ({result['words']:,} words)", _number(result["adjusted_perplexity"]))
    table.add_row(f"lm-eval (non-overlapping, {result['seq_len']})", f"word_perplexity ({lm['words']:,} words)", _number(lm["word_perplexity"]))
    table.add_row(f"{lm['documents']:,} documents ({result['document_rule']})", "byte_perplexity", _number(lm["byte_perplexity"]))
    table.add_row("", f"bits_per_byte ({lm['bytes']:,} bytes)", f"{lm['bits_per_byte']:.4f}")
    console = zoa_console.out
    console.print(table)
    console.print(f"{result['tokens']:,} tokens in {result['windows']:,} windows, {result['seconds']:.1f}s", highlight=False)


def evaluate_lambada(checkpoint: Path, data: str, batch_size: int, seq_len: int = 0) -> dict | None:
    """`eval lambada`'s result as a dict on rank 0 (None on the other ranks); `seq_len` 0: the model's n_positions."""
    if batch_size < 1 or seq_len < 0 or seq_len == 1:
        raise UserError("--batch-size must be at least 1 and --seq-len at least 2 (or 0 for the model's n_positions).")
    started = time.perf_counter()
    texts, source = read_lambada(data)
    loaded = _load(checkpoint, "lambada")
    n_positions = model_context(loaded.model)
    limits = [n for n in (seq_len, n_positions) if n]
    used_seq_len = min(limits) if limits else None
    windows, cut = lambada_windows(loaded.tokenizer, texts, used_seq_len)
    from zoa_train.distributed import evaluation_ranks

    with evaluation_ranks() as ranks:
        loaded.model.to(ranks.device)
        (sums,) = _score_with_progress(loaded.model, [("LAMBADA", windows)], batch_size, ranks, loaded.tokenizer.eos_token_id or 0)
        if ranks.rank != 0:
            return None
        world = ranks.world
    return {
        "protocol": "LAMBADA (OpenAI version, lm-evaluation-harness lambada_openai): strict last-word accuracy",
        **_described(loaded, source),
        "seq_len": used_seq_len,
        "n_positions": n_positions,
        "contexts_cut": cut,
        **lambada_metrics(sums),
        "ranks": world,
        "seconds": time.perf_counter() - started,
    }


def lambada_command(
    checkpoint: Annotated[Path, typer.Option(help=CHECKPOINT_HELP, show_default=False)],
    data: Annotated[
        str,
        typer.Option(
            help="The LAMBADA test set as JSON lines with a \"text\" field (OpenAI's version), or 'hub' for EleutherAI/lambada_openai (online). [default: hub]",
            show_default=False,
        ),
    ] = HUB,
    batch_size: Annotated[int, typer.Option(help="Examples per forward pass. [default: 8]", show_default=False)] = 8,
    seq_len: Annotated[
        int,
        typer.Option(
            help="Longest input: longer contexts lose their start (a model trained on short windows does best at its training length). [default: the model's n_positions]",
            show_default=False,
        ),
    ] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.", show_default=False)] = None,
) -> None:
    """LAMBADA last-word prediction of a causal LM (GPT-2, Llama): strict accuracy (every token of the word the argmax), target perplexity and lm-evaluation-harness's perplexity; split over the ranks under torchrun or srun."""
    from rich.table import Table

    from zoa_train import console as zoa_console
    from zoa_train.files import check_output_file, write_json_file

    if json_out is not None:
        check_output_file(json_out, "--json")  # before the evaluation: its result must have somewhere to go
    result = evaluate_lambada(checkpoint, data, batch_size, seq_len)
    if result is None:
        return
    if json_out is not None:
        write_json_file(json_out, result, "--json")
    step = f" step {result['step']}" if result["step"] is not None else ""
    table = Table(title=f"LAMBADA: {result['checkpoint']}{step} on {result['data']}")
    for name in ("examples", "accuracy (strict)", "target-token perplexity", "lm-eval perplexity (per example)"):
        table.add_column(name, justify="right")
    table.add_row(f"{result['examples']:,}", f"{100 * result['accuracy']:.2f}%", _number(result["target_perplexity"]), _number(result["lm_eval_perplexity"]))
    console = zoa_console.out
    console.print(table)
    console.print(f"{result['correct']:,} correct, {result['target_tokens']:,} target tokens, {result['seconds']:.1f}s", highlight=False)
