"""Tokenizers: a pretrained one by name or directory, or one trained on the corpus in seconds.

Training our own keeps the tiny recipes offline and gives a vocabulary sized for a small model:
byte-level BPE as in GPT-2 (no unknown tokens, any byte encodes), lowercase WordPiece as in BERT.
A trained tokenizer is saved with ``save_pretrained`` so ``AutoTokenizer.from_pretrained(out_dir)``
loads it back like any other.
"""

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from zoa_train.data.cache import exclusive_lock, temporary_name
from zoa_train.errors import UserError
from zoa_train.pretrained import existing

if TYPE_CHECKING:  # transformers takes seconds to import: only when a tokenizer is loaded
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

KINDS = ("gpt2", "bert")
GPT2_EOS = "<|endoftext|>"
BERT_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
# What the data pipeline needs from a tokenizer of each kind, pretrained or not.
_REQUIRED = {"gpt2": ("eos_token",), "bert": ("cls_token", "sep_token", "mask_token")}


def load_or_train_tokenizer(
    kind: str,
    name_or_path: str | None,
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
) -> "PreTrainedTokenizerBase":
    """A pretrained tokenizer when ``name_or_path`` is given, else the one in ``out_dir``, else a new one trained on ``texts``.

    ``out_dir`` acts as a cache: it should be specific to the corpus and ``vocab_size``. Ranks that
    call this together train once: the first takes a lock and trains, the others wait and load.
    ``texts`` is only consumed when training.
    """
    from transformers import AutoTokenizer

    if kind not in KINDS:
        raise UserError(f"Tokenizer kind must be one of {', '.join(KINDS)}, not {kind!r}.")
    if name_or_path:
        tokenizer = _load_pretrained(name_or_path)
    else:
        out_dir = Path(out_dir)
        with exclusive_lock(out_dir.with_name(out_dir.name + ".lock")):
            if not (out_dir / "tokenizer.json").exists():
                _train_and_save(kind, texts, vocab_size, out_dir)
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
    missing = [name for name in _REQUIRED[kind] if getattr(tokenizer, name) is None]
    if missing:
        raise UserError(f"Tokenizer {name_or_path or out_dir} has no {', '.join(missing)}, which a {kind} model needs.")
    return tokenizer


def load_saved_tokenizer(kind: str, directory: str | Path) -> "PreTrainedTokenizerBase":
    """A run's saved tokenizer (its tokenizer/ directory) as its model needs it. A tokenizer trained by
    zoa-train omits token_type_ids, which BERT's sentence pairs need (segment B is 1, as in training);
    asking for them also records them in a re-saved tokenizer_config.json."""
    from transformers import AutoTokenizer

    inputs = {"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]} if kind == "bert" else {}
    return AutoTokenizer.from_pretrained(directory, **inputs)


def _load_pretrained(name_or_path: str) -> "PreTrainedTokenizerBase":
    """A hub name or a local directory; offline only a local directory (or a hub cache) works."""
    from transformers import AutoTokenizer

    where = existing(name_or_path, "data.tokenizer", "the tokenizer's files, or leave data.tokenizer unset to train one on the corpus")
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") if str(e).strip() else type(e).__name__  # its first sentence of several
        raise UserError(f"data.tokenizer {name_or_path} could not be loaded ({first}); offline, give a local directory or leave it unset to train one.") from e


def _train_and_save(kind: str, texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train, save into a temporary directory, then move the files in with ``tokenizer.json`` last: its presence means complete."""
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    backend, trainer, specials = _gpt2_bpe(vocab_size) if kind == "gpt2" else _bert_wordpiece(vocab_size)
    backend.train_from_iterator(texts, trainer=trainer)
    if kind == "bert":
        backend.model = models.WordPiece(_canonical_ids(backend.get_vocab()), unk_token=BERT_SPECIALS["unk_token"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    tmp = temporary_name(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "tokenizer.json"):
        os.replace(f, out_dir / f.name)
    tmp.rmdir()
    log.info("Trained a %s tokenizer (%d tokens) in %.1fs -> %s", kind, len(tokenizer), time.perf_counter() - started, out_dir)


def _canonical_ids(vocab: dict[str, int]) -> dict[str, int]:
    """The same ids for the same corpus in every process. The WordPiece trainer numbers the "##"
    alphabet, and merges of equal count, in hash-map order, which differs from process to process
    (the tokens are the same): the special tokens keep their ids, the others are numbered single
    characters first, then their "##" forms, then the rest, each group in string order. WordPiece
    encodes by the strings alone, so only the numbering changes."""
    specials = list(BERT_SPECIALS.values())
    rest = sorted((t for t in vocab if t not in specials), key=lambda t: (len(t.removeprefix("##")) > 1, t.startswith("##"), t))
    return {token: i for i, token in enumerate(specials + rest)}


def _gpt2_bpe(vocab_size: int) -> tuple[Tokenizer, trainers.Trainer, dict[str, str]]:
    """GPT-2's scheme: BPE over bytes, spaces kept as part of the following word, one end-of-text token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[GPT2_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return backend, trainer, {"bos_token": GPT2_EOS, "eos_token": GPT2_EOS, "unk_token": GPT2_EOS}


def _bert_wordpiece(vocab_size: int) -> tuple[Tokenizer, trainers.Trainer, dict[str, str]]:
    """BERT-uncased's scheme: lowercase, accents stripped, split on whitespace and punctuation, ``##`` continuations."""
    backend = Tokenizer(models.WordPiece(unk_token=BERT_SPECIALS["unk_token"]))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    cls, sep = BERT_SPECIALS["cls_token"], BERT_SPECIALS["sep_token"]
    specials = list(BERT_SPECIALS.values())
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, specials.index(cls)), (sep, specials.index(sep))],
    )
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials, continuing_subword_prefix="##", show_progress=False)
    return backend, trainer, dict(BERT_SPECIALS)
