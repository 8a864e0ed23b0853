"""Loading a trained language model for evaluation or export, from whatever the user points at.

`load_language_model(path)` accepts a run directory (its latest complete checkpoint), a checkpoint
directory, a model file inside a run directory, or a Hugging Face directory (`zoa-train export`'s
output, or any model of a registered language family saved with save_pretrained: GPT-2, BERT, Llama).
A checkpoint's model is its model.pt, or a sharded run's model/ (every rank's shards, written through
torch.distributed.checkpoint), read whole here in one process without a process group.
The model family's registry entry (zoa_train/models/registry.py) says how a checkpoint is rebuilt
(its builder, from the run's recipe and tokenizer; from the config the run recorded in model_config/
where the recipe alone does not name the model: model.init_from, model.hf_config), which Hugging Face
model types it holds, and which evaluations accept it. A checkpoint taken inside a 0/1 Adam
local-step period holds each rank's own parameters (rank_XXXXX.pt "model"; a sharded run's, each
node's under model/node_N); its model is then their average, and `averaged_ranks` says how many
were averaged.
"""

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from zoa_train.errors import UserError
from zoa_train.models import registry as models
from zoa_train.models.builders import state_difference

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # on the CPU, in eval mode
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    kind: str  # the model family (model.kind): "gpt2", "bert", "llama", ...
    step: int | None  # the checkpoint's step, when known
    source: str  # what was loaded, for reports
    averaged_ranks: int = 1  # > 1: the ranks' parameters differed and were averaged

    @property
    def auto_class(self) -> str:
        """The transformers Auto class that loads this model once saved (e.g. AutoModelForCausalLM)."""
        from zoa_train.tasks import task_of

        return task_of(self.kind).auto_class(type(self.model).__name__)


def load_language_model(path: str | Path, evaluation: str | None = None) -> LoadedModel:
    """The model and tokenizer at `path`; `evaluation` (e.g. "wikitext") refuses, in one sentence, a
    family whose registry entry does not list it."""
    path = Path(path)
    loaded = _load_hugging_face(path) if (path / "config.json").is_file() else _load_checkpoint(path)
    if evaluation is not None and evaluation not in models.get(loaded.kind).evaluations:
        *others, last = [spec.title for spec in models.accepting(evaluation)]
        wanted = f"{', '.join(others)} or {last}" if others else last
        raise UserError(f"{path} holds a {models.get(loaded.kind).title} model; this evaluation needs a {wanted} model.")
    loaded.model.eval()
    return loaded


def _language_families() -> str:
    return ", ".join(spec.title for spec in map(models.get, models.names()) if spec.tokenizer)


def _load_hugging_face(path: Path) -> LoadedModel:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        spec = _exported_family(path) or models.of_hf_model_type(config.model_type)
        if spec is None or not spec.tokenizer:
            raise UserError(f"{path} holds a {config.model_type} model; zoa-train evaluates {_language_families()} models.")
        from zoa_train.tasks import task_of

        auto_class = task_of(spec.kind).auto_class((config.architectures or [None])[0])
        model = getattr(transformers, auto_class).from_pretrained(path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a loadable Hugging Face model directory: {str(e).strip().splitlines()[0]}") from None
    return LoadedModel(model, tokenizer, spec.kind, None, str(path))


def run_recipe(run_dir: Path):
    """The recipe a run trained with, as its recipe.yaml holds it (resolved, and checked when the run began),
    its imports imported (the families of one's own). Not checked again against what lies outside the run
    (data files, model.init_from, data.tokenizer): eval and export read none of it, and it may have moved."""
    import yaml

    from zoa_train.config import Recipe, build_section
    from zoa_train.files import load_yaml
    from zoa_train.optim import registry

    path = run_dir / "recipe.yaml"
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    except (UnicodeDecodeError, yaml.YAMLError):
        raise UserError(f"{path} is not the YAML recipe that zoa-train run writes.") from None
    if isinstance(data, dict) and data.get("imports"):
        registry.import_modules(data["imports"], str(path))
    return build_section(Recipe, data, str(path))


def _exported_family(path: Path):
    """The family `zoa-train export` recorded beside the model (its zoa_export.json, export.py's RECORD), or
    None: an hf_causal_lm run of a BERT config exports a bert model type that is no BERT masked LM."""
    import json

    try:
        return models.find(json.loads((path / "zoa_export.json").read_text()).get("model_kind"))
    except (OSError, ValueError, AttributeError):
        return None


def _load_checkpoint(path: Path) -> LoadedModel:
    from zoa_train.data.tokenizer import load_saved_tokenizer
    from zoa_train.models import ModelInputs, create
    from zoa_train.tasks.language import MODEL_CONFIG

    model_file, run, state, ranks, step = _read_state(path)
    if run is None:
        raise UserError(f"{model_file} lies outside a run directory: its recipe.yaml and tokenizer/ are needed to rebuild the model.")
    recipe = run_recipe(run.path)
    kind = recipe.model.kind
    spec = models.get(kind)
    if not spec.tokenizer:
        raise UserError(f"{run.path} trained a {kind} model; this needs a run of a language model ({_language_families()}).")
    tokenizer_dir = run.path / "tokenizer"
    if not tokenizer_dir.is_dir():
        raise UserError(f"run directory {run.path} has no tokenizer/ directory.")
    tokenizer = load_saved_tokenizer(spec.tokenizer, tokenizer_dir)
    recorded = run.path / MODEL_CONFIG
    if (recorded / "config.json").is_file():  # a model the recipe alone does not name (init_from, hf_config)
        model, described = _from_recorded_config(recorded, kind), recorded / "config.json"
    else:
        cfg = dataclasses.replace(recipe.model, init_from=None)  # the weights come from the checkpoint
        model = create(cfg, ModelInputs.of_tokenizer(tokenizer, recipe.data.seq_len))  # as the task built it
        described = run.path / "recipe.yaml"
    difference = state_difference(model.state_dict(), state)
    if difference:
        if recipe.model.init_from and described.name == "recipe.yaml":  # a run from before the config was recorded
            fix = f"the run trained the model of model.init_from {recipe.model.init_from}: copy its config.json into {recorded}/ to rebuild that"
        else:
            fix = f"{described.name} was changed after the run wrote it: put back the one the run wrote"
        raise UserError(f"{model_file} does not fit the model that {described} describes ({difference}); {fix}.")
    model.load_state_dict(state)
    return LoadedModel(model, tokenizer, kind, step, str(model_file), ranks)


def _from_recorded_config(directory: Path, kind: str) -> torch.nn.Module:
    """The model of a run's recorded config (tasks/language.py: MODEL_CONFIG), built as its task's Auto
    class builds the recorded architecture, with fresh weights for the checkpoint's."""
    import transformers

    from zoa_train.tasks import task_of

    try:
        config = transformers.AutoConfig.from_pretrained(directory)
        auto_class = task_of(kind).auto_class((config.architectures or [None])[0])
        return getattr(transformers, auto_class).from_config(config)
    except (OSError, ValueError) as e:
        raise UserError(f"{directory / 'config.json'} is not the model config the run recorded ({str(e).strip().splitlines()[0]}).") from None


def _read_state(path: Path):
    """(model file or directory, its run directory, the model's state, ranks averaged, the checkpoint's step
    or None) of what `path` names."""
    from zoa_train.train.rundir import resolve_model_file

    model_file, run = resolve_model_file(path)
    try:
        state, ranks = read_model_state(model_file)
    except FileNotFoundError:
        # A run still training rotates its checkpoints: the latest one may be gone by now. Once more, the
        # newest complete one, whose files are then held open (a removal cannot take them away).
        if not (path / "checkpoints").is_dir():
            raise UserError(f"checkpoint {model_file.parent} was removed while it was being read.") from None
        gone = model_file.parent
        model_file, run = resolve_model_file(path)
        log.warning("checkpoint %s was removed while it was being read (the run is rotating its checkpoints); reading %s instead", gone, model_file.parent)
        state, ranks = read_model_state(model_file)
    step = _step(model_file.parent)
    return model_file, run, state, ranks, step


def read_model_state(model_file: Path) -> tuple[dict, int]:
    """The model's state and how many ranks' (nodes') models were averaged into it: model.pt, or the ranks'
    own models beside it where they differ; a sharded model directory's one model, or its nodes' average."""
    if model_file.is_dir():
        from zoa_train.train.checkpointer import read_whole

        models = read_whole(model_file)
        if "model" in models:
            return models["model"], 1
        nodes = [models[key] for key in sorted((k for k in models if k.startswith("node_")), key=lambda k: int(k.removeprefix("node_")))]
        if not nodes:
            raise UserError(f"{model_file} holds no model (neither model nor node_N).")
        return _average(nodes), len(nodes)
    return _averaged_state(_hold(model_file))


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
    return _average(per_rank), len(per_rank)


def _average(states: list[dict]) -> dict:
    """The models' average: floats averaged, integer buffers taken from the first."""
    averaged = {}
    for key, value in states[0].items():
        if value.is_floating_point():
            averaged[key] = torch.stack([s[key].float() for s in states]).mean(dim=0).to(value.dtype)
        else:
            averaged[key] = value
    return averaged


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
