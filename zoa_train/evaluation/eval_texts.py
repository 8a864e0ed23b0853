"""The texts of the zero-shot evaluations as their protocols read them (zoa-train eval wikitext and eval
lambada, language.py): WikiText's word-level text detokenized and cut into documents, words counted as
Megatron-LM and lm-evaluation-harness count them, LAMBADA's examples split at their last word; each read
from a local file or the hub's test split, every fault in one sentence.
"""

import json
import re
from collections.abc import Sequence
from pathlib import Path

from zoa_train.errors import UserError

HUB = "hub"
WIKITEXT_HUB = ("Salesforce/wikitext", "wikitext-103-raw-v1")  # the hub's `wikitext` dataset, under its owner's name
LAMBADA_HUB = ("EleutherAI/lambada_openai", "default")


# --- WikiText detokenization -----------------------------------------------------------------
# The rules lm-evaluation-harness (after Megatron-LM) applies to WikiText's word-level text, in order.
_SEPARATORS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))  # hyphens and number separators
_PUNCTUATION = tuple((f" {mark} ", f"{mark} ") for mark in ":;.!?,")  # no space before punctuation
_PAIRS = (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'"))  # no spaces just inside brackets and quotes
_PAIR_PATTERNS = tuple(
    (re.compile(f"{re.escape(opening)}\\s*([^{re.escape(closing)}]*?)\\s*{re.escape(closing)}"), f"{opening}\\1{closing}") for opening, closing in _PAIRS
)
_HEADINGS = (("= = = =", "===="), ("= = =", "==="), ("= =", "=="))  # section heading markers, longest first
_LAST = ((" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s"))


def wikitext_detokenize(text: str) -> str:
    """WikiText's word-level text (`wiki.test.tokens`) back to ordinary text for a BPE model.

    Plural possessives (`players '` -> `players'`), `@-@`/`@,@`/`@.@` joined, no space before
    : ; . ! ? , marks, none inside (), [], {}, "" and '' pairs, `= = =` heading markers closed up,
    `°` joined, spaces around line breaks dropped, `N` (a number placeholder) as 1, and ` 's` joined.
    """
    text = text.replace("s '", "s'")
    for old, new in _SEPARATORS + _PUNCTUATION:
        text = text.replace(old, new)
    for pattern, replacement in _PAIR_PATTERNS:
        text = pattern.sub(replacement, text)
    for old, new in _HEADINGS + _LAST:
        text = text.replace(old, new)
    return text


def megatron_word_count(original: str) -> int:
    """Words of WikiText's word-level text as Megatron-LM counts them for the adjusted perplexity:
    space-separated items of the stripped text, so each line break counts as one (WikiText's <eos>)."""
    return len(original.strip().split(" "))


def lm_eval_word_count(original: str) -> int:
    """Words as lm-evaluation-harness's wikitext task counts them on an original (not detokenized) document."""
    return len(re.split(r"\s+", original))


_ARTICLE_TITLE = re.compile(r"^ = [^=].* = $", re.MULTILINE)


def split_articles(original: str) -> list[str]:
    """WikiText's text cut before each top-level ` = Title = ` heading line (one article each; text
    before the first heading stays with the first article); one piece when there is no heading."""
    starts = [m.start() for m in _ARTICLE_TITLE.finditer(original)]
    cuts = [0, *starts[1:], len(original)]
    return [original[a:b] for a, b in zip(cuts, cuts[1:]) if original[a:b]]


# What a document is for lm-evaluation-harness's pass: the harness scores each one alone. lines and
# paragraphs are the rows Hugging Face datasets' `text` loader makes of a file (what the harness reads
# with `dataset_path: text`, by default and with `sample_by: paragraph`); jsonl those of its `json` loader.
DOCUMENT_RULES = {
    "headings": "one document per WikiText article (a new one at each top-level ' = Title = ' line)",
    "lines": "one document per line (empty lines too), as datasets' text loader reads a file",
    "paragraphs": "one document per paragraph between empty lines, as datasets' text loader with sample_by=paragraph",
    "jsonl": "one document per JSON line's text field",
}


def split_documents(text: str, rule: str) -> list[str]:
    """`text` cut into documents under `rule` (see DOCUMENT_RULES; jsonl documents are read, not cut):
    lines without their line break, an empty line an empty document (the harness scores nothing in it
    and counts it one word); paragraphs the pieces between "\\n\\n", empty pieces dropped."""
    if rule == "headings":
        return split_articles(text)
    if rule == "lines":
        return text.removesuffix("\n").split("\n")
    if rule == "paragraphs":
        return [p for p in text.split("\n\n") if p]
    raise ValueError(f"no document rule {rule!r} for a plain text")


def joined_documents(documents: Sequence[str]) -> str:
    """JSON-lines documents as one text for the sliding-window pass: each ending with a line break, so
    that a document-level WikiText export (lm-eval's `page` field) joins back into its file."""
    return "".join(d if d.endswith("\n") else d + "\n" for d in documents)


# --- Reading the data ---------------------------------------------------------------------------
def read_wikitext(data: str, rule: str = "headings", text_field: str = "text") -> tuple[str, list[str], str]:
    """The original text, its documents under `rule` and a description of where they came from: a local
    file (plain text, or JSON lines with `text_field` for rule jsonl), or the hub's test split."""
    if data == HUB:
        if rule == "jsonl":
            raise UserError("--documents jsonl reads a local JSON-lines file; give it with --data, or another --documents rule for --data hub.")
        import datasets

        name, config = WIKITEXT_HUB
        try:
            lines = datasets.load_dataset(name, config, split="test")["text"]
        except Exception as e:  # noqa: BLE001 -- offline, renamed, or missing: all the same to the user
            raise UserError(
                f"could not load the hub dataset {name} ({config}): {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}; offline, give --data wiki.test.tokens."
            ) from None
        # The hub keeps the file's lines with their line breaks, and its blank lines (" \n" in the file) as "".
        text = "".join(line or " \n" for line in lines)
        return text, split_documents(text, rule), f"hub:{name}/{config}/test"
    if rule == "jsonl":
        expected = f'JSON lines with a "{text_field}" string each (--text-field)'
        documents = read_json_field(data, text_field, expected)
        if not any(d.strip() for d in documents):
            raise UserError(f'--data {data} holds no text in its "{text_field}" fields; give {expected}.')
        return joined_documents(documents), documents, str(Path(data))
    expected = "a WikiText test file such as wiki.test.tokens, or with --raw any UTF-8 text"
    text = read_text_file(data, expected + ", or 'hub'")
    if not text.strip():
        raise UserError(f"--data {data} holds no text; give {expected}.")
    return text, split_documents(text, rule), str(Path(data))


def read_text_file(data: str, expected: str) -> str:
    """The UTF-8 file `data` (line breaks as Python and datasets' loaders read them: \\r\\n and \\r as \\n);
    `expected`, what the file should be, ends each refusal."""
    path = Path(data)
    if not path.is_file():
        raise UserError(f"--data {data} does not exist; give {expected}.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--data {data} is not UTF-8 text; give {expected}.") from None


def read_json_field(data: str, field: str, expected: str) -> list[str]:
    """The `field` string of each non-blank line of the JSON-lines file `data`."""
    texts = []
    for number, line in enumerate(read_text_file(data, expected).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(f'line {number} of {data} is not a JSON object with a "{field}" string; give {expected}.')
        texts.append(text)
    if not texts:
        raise UserError(f"--data {data} holds no JSON lines; give {expected}.")
    return texts


def split_last_word(text: str) -> tuple[str, str]:
    """(context, target): target is " " + the last word, context everything before that space."""
    context, _, word = text.strip().rpartition(" ")
    return context, " " + word


def read_lambada(data: str) -> tuple[list[str], str]:
    """The examples' texts and where they came from: a JSON-lines file with a `text` field, or the hub's test split."""
    if data == HUB:
        import datasets

        name, config = LAMBADA_HUB
        try:
            texts = datasets.load_dataset(name, config, split="test")["text"]
        except Exception as e:  # noqa: BLE001
            raise UserError(
                f"could not load the hub dataset {name} ({config}): {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}; offline, give --data lambada_test.jsonl."
            ) from None
        return list(texts), f"hub:{name}/{config}/test"
    texts = read_json_field(data, "text", "the LAMBADA test set as JSON lines with a \"text\" field, or 'hub'")
    for number, text in enumerate(texts, 1):
        if " " not in text.strip():
            raise UserError(f"example {number} of {data} has no context before its last word.")
    return texts, str(Path(data))
