"""Loading a trained language model for evaluation or export, from whatever the user points at.

`load_language_model(path)` accepts a run directory (its latest complete checkpoint), a checkpoint
directory, a model file inside a run directory, or a Hugging Face directory (`zoa-train export`'s
output, or any GPT-2/BERT model saved with save_pretrained). A checkpoint taken inside a 0/1 Adam
local-step period holds each rank's own parameters (rank_XXXXX.pt "model"); its model is then the
ranks' average, and `averaged_ranks` says how many were averaged.
"""

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from zoa_train.errors import UserError

FAMILIES = {"gpt2": "GPT-2", "bert": "BERT"}

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # on the CPU, in eval mode
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    kind: str  # "gpt2" or "bert"
    step: int | None  # the checkpoint's step, when known
    source: str  # what was loaded, for reports
    averaged_ranks: int = 1  # > 1: the ranks' parameters differed and were averaged


def load_language_model(path: str | Path, expect: str | None = None) -> LoadedModel:
    """The model and tokenizer at `path`; `expect` ("gpt2" or "bert") refuses the other family in one sentence."""
    path = Path(path)
    loaded = _load_hugging_face(path) if (path / "config.json").is_file() else _load_checkpoint(path)
    if expect is not None and loaded.kind != expect:
        raise UserError(f"{path} holds a {FAMILIES.get(loaded.kind, loaded.kind)} model; this evaluation needs a {FAMILIES[expect]} model.")
    loaded.model.eval()
    return loaded


def _load_hugging_face(path: Path) -> LoadedModel:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        if config.model_type not in FAMILIES:
            raise UserError(f"{path} holds a {config.model_type} model; zoa-train evaluates GPT-2 and BERT models.")
        if config.model_type == "gpt2":
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
        elif "BertForPreTraining" in (config.architectures or []):
            model = transformers.AutoModelForPreTraining.from_pretrained(path)
        else:
            model = transformers.AutoModelForMaskedLM.from_pretrained(path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a loadable Hugging Face model directory: {str(e).strip().splitlines()[0]}") from None
    return LoadedModel(model, tokenizer, config.model_type, None, str(path))


def _load_checkpoint(path: Path) -> LoadedModel:
    import transformers

    from zoa_train.config import load_recipe
    from zoa_train.models import build_bert, build_gpt2

    model_file, run, state, ranks, step = _read_state(path)
    if run is None:
        raise UserError(f"{model_file} lies outside a run directory: its recipe.yaml and tokenizer/ are needed to rebuild the model.")
    recipe = load_recipe(run.path / "recipe.yaml")
    kind = recipe.model.kind
    if kind not in FAMILIES:
        raise UserError(f"{run.path} trained a {kind} model; this needs a GPT-2 or BERT run.")
    tokenizer_dir = run.path / "tokenizer"
    if not tokenizer_dir.is_dir():
        raise UserError(f"run directory {run.path} has no tokenizer/ directory.")
    # A tokenizer trained by zoa-train omits token_type_ids, which BERT's sentence pairs need (segment B
    # is 1, as in training); asking for them also records them in a re-saved tokenizer_config.json.
    inputs = {"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]} if kind == "bert" else {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, **inputs)
    cfg = dataclasses.replace(recipe.model, init_from=None)  # the weights come from the checkpoint
    if kind == "gpt2":
        model = build_gpt2(cfg, len(tokenizer), recipe.data.seq_len, tokenizer.eos_token_id)
    else:
        model = build_bert(cfg, len(tokenizer), recipe.data.seq_len, tokenizer.pad_token_id)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise UserError(f"{model_file} does not fit the model of {run.path / 'recipe.yaml'}: {str(e).strip().splitlines()[0]}") from None
    return LoadedModel(model, tokenizer, kind, step, str(model_file), ranks)


def _read_state(path: Path):
    """(model file, its run directory, the model's state, ranks averaged, the checkpoint's step or None)
    of what `path` names."""
    from zoa_train.train.rundir import resolve_model_file

    model_file, run = resolve_model_file(path)
    try:
        held = _hold(model_file)
    except FileNotFoundError:
        # A run still training rotates its checkpoints: the latest one may be gone by now. Once more, the
        # newest complete one, whose files are then held open (a removal cannot take them away).
        if not (path / "checkpoints").is_dir():
            raise UserError(f"checkpoint {model_file.parent} was removed while it was being read.") from None
        gone = model_file.parent
        model_file, run = resolve_model_file(path)
        log.warning("checkpoint %s was removed while it was being read (the run is rotating its checkpoints); reading %s instead", gone, model_file.parent)
        held = _hold(model_file)
    step = _step(model_file.parent)
    return model_file, run, *_averaged_state(held), step


def _step(checkpoint: Path) -> int | None:
    """The step a checkpoint's marker records (None for a model file outside a checkpoint, or a marker
    removed since its files were opened: the step is then unknown, not wrong)."""
    from zoa_train.train.rundir import read_marker

    try:
        return read_marker(checkpoint).get("step")
    except FileNotFoundError:
        return None


def _hold(model_file: Path) -> dict[Path, object]:
    """model.pt and the rank files beside it, each opened now (FileNotFoundError if one is gone): what is
    read from them later is what they held now, even if the checkpoint is removed meanwhile."""
    files = [model_file, *sorted(model_file.parent.glob("rank_*.pt"))]
    held = {}
    try:
        for file in files:
            held[file] = open(file, "rb")
    except BaseException:
        for f in held.values():
            f.close()
        raise
    return held


def _averaged_state(held: dict[Path, object]) -> tuple[dict, int]:
    """model.pt (the first of the held files), or the average of the ranks' own models when the
    checkpoint holds them (floats are averaged, integer buffers taken from rank 0)."""
    (model_file, opened), *rank_files = held.items()
    try:
        state = _read(model_file, opened)
        per_rank = []
        for rank_file, rank_opened in rank_files:
            saved = _read(rank_file, rank_opened)
            if isinstance(saved, dict) and "model" in saved:
                per_rank.append(saved["model"])
    finally:
        for f in held.values():
            f.close()
    if not per_rank:
        return state, 1
    averaged = {}
    for key, value in per_rank[0].items():
        if value.is_floating_point():
            averaged[key] = torch.stack([s[key].float() for s in per_rank]).mean(dim=0).to(value.dtype)
        else:
            averaged[key] = value
    return averaged, len(per_rank)


def _read(file: Path, opened):
    """A checkpoint file (`opened`, its open file), tensors and plain values only (train/rundir.py:
    read_checkpoint_file); a file torch cannot read (truncated, not a checkpoint) refused in one sentence too."""
    from zoa_train.train.rundir import read_checkpoint_file

    try:
        return read_checkpoint_file(file, opened=opened)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- unpickling, zip and version errors alike: the file is unusable
        # torch's own messages run to several sentences: the exception's name is enough to go on.
        raise UserError(f"{file} is not a readable PyTorch checkpoint file ({type(e).__name__}).") from None
