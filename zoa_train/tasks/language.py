"""causal_lm (GPT-2, Llama) and masked_lm (BERT): a tokenizer and token streams (zoa_train/data), a
transformers model from the family's builder (zoa_train/models), and its own loss (`model(**batch).loss`)."""

import logging
from pathlib import Path

import torch

from zoa_train.errors import UserError
from zoa_train.models import ModelInputs, create, registry
from zoa_train.pretrained import existing
from zoa_train.tasks.base import IMAGE_SOURCES, Task

# The run directory's record of the model's Hugging Face config (config.json), where the recipe does not name
# the model alone (model.init_from, model.hf_config): what eval and export rebuild the model from.
MODEL_CONFIG = "model_config"

log = logging.getLogger(__name__)


class NotCounted(ValueError):
    """A model whose FLOPs per token the transformer formula does not give; the message says why."""


def transformer_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs of one training token, forward and backward, of a transformers model: 6 N + 12 L H Q T
    (PaLM's accounting, docs/metrics.md "MFU"). N: the parameters that multiply activations, i.e. all but
    the embedding tables that are looked up (token, position, token type), with the output layer counted
    even where it is the token embedding (tied); L layers, H heads of width Q, each attending to T =
    seq_len tokens (a sliding window's layer to at most its window). NotCounted for a model it does not fit."""
    config = getattr(model, "config", None)
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        raise NotCounted("its config names no number of layers and attention heads")
    if any(getattr(config, key, None) for key in ("num_experts_per_tok", "num_local_experts", "num_experts", "n_routed_experts")):
        raise NotCounted("it is a mixture of experts, which runs only some of its parameters on each token")
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if other:
        raise NotCounted(f"it has layers of type {', '.join(other)}, which the formula for attention does not count")
    spans = sum(min(seq_len, window) if kind == "sliding_attention" and window else seq_len for kind in kinds)
    head_width = getattr(config, "head_dim", None) or config.hidden_size // heads
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    multiplying = sum(p.numel() for p in model.parameters() if id(p) not in looked_up)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and id(output.weight) in looked_up:  # tied: one tensor, and a matmul all the same
        multiplying += output.weight.numel()
    return 6.0 * multiplying + 12.0 * heads * head_width * spans


class LanguageTask(Task):
    unit = "tokens"
    metrics = ("val_loss",)

    def __init__(self, recipe, rank: int, world_size: int):
        from zoa_train.data import DistributedBatchLoader, TextSource, prepare_lm_data

        super().__init__(recipe, rank, world_size)
        d, t = recipe.data, recipe.train
        source = TextSource(
            name=d.source, config=d.config, train_files=tuple(d.train_files), validation_files=tuple(d.validation_files), text_field=d.text_field
        )
        tokenizer_family = registry.get(recipe.model.kind).tokenizer  # the kind of tokenizer trained when none is given
        self.val_layout = (rank, world_size)  # whose slice of val_blocks this rank validates on
        if d.streaming:  # read while training, each rank its own part of the stream (zoa_train/data/streaming.py)
            from zoa_train.data.streaming import open_lm_stream

            stream = open_lm_stream(source, tokenizer_family, recipe, rank, world_size)
            self.tokenizer, self.units_per_sample = stream.tokenizer, d.seq_len
            self.loader, self.val_blocks, self.val_layout = stream.batches(self.blocks), stream.validation(self.blocks), (0, 1)  # its own val_blocks
            return
        if d.source == "megatron":  # Megatron indexed datasets, mapped as they are (zoa_train/data/megatron.py)
            from zoa_train.data.prepare import prepare_megatron_data

            data = prepare_megatron_data(d.prefixes, d.weights, d.validation_prefixes, d.tokenizer, tokenizer_family, Path(d.cache_dir).expanduser())
        else:
            data = prepare_lm_data(source, tokenizer_family, Path(d.cache_dir).expanduser(), d.tokenizer, d.vocab_size, d.tokenize_workers)
        self.tokenizer = data.tokenizer
        self.units_per_sample = d.seq_len
        self.loader = DistributedBatchLoader(self.blocks(data.train), t.micro_batch_size, rank, world_size, t.seed, t.global_batch_size)
        self.val_blocks = self.blocks(data.validation)

    @classmethod
    def check(cls, recipe, origin: str) -> None:
        d = recipe.data
        if d.source in IMAGE_SOURCES:
            raise UserError(f"{origin}: data.source {d.source} is an image set; {recipe.model.kind} trains on text (bundled, files or a hub dataset).")
        if d.source == "files" and not d.train_files:
            raise UserError(f"{origin}: data.train_files must name at least one file when data.source is files.")
        for name in d.train_files + d.validation_files:
            if not any(ch in name for ch in "*?[") and not Path(name).expanduser().exists():
                raise UserError(f"{origin}: data file {name} does not exist.")
        if d.tokenizer:
            try:
                existing(d.tokenizer, "data.tokenizer", "the tokenizer's files, or leave data.tokenizer unset to train one on the corpus")
            except UserError as e:
                raise UserError(f"{origin}: {e}") from None
        from zoa_train.data.megatron import check_recipe

        check_recipe(d, origin)
        if d.streaming:
            from zoa_train.data.streaming import check_streaming

            check_streaming(recipe, origin)

    @classmethod
    def model_for_counting(cls, recipe) -> torch.nn.Module:
        return create(recipe.model, ModelInputs(recipe.data.vocab_size, recipe.data.seq_len))

    def build_model(self) -> torch.nn.Module:
        m = self.recipe.model
        model = create(m, ModelInputs.of_tokenizer(self.tokenizer, self.recipe.data.seq_len))
        if m.init_from and len(self.tokenizer) > model.config.vocab_size:  # its ids would index past the embedding
            where = f"data.tokenizer {self.recipe.data.tokenizer}" if self.recipe.data.tokenizer else "the tokenizer trained on the corpus"
            raise UserError(
                f"{where} has {len(self.tokenizer):,} tokens and the model in model.init_from {m.init_from} embeds {model.config.vocab_size:,}; "
                "set data.tokenizer to the model's own tokenizer (its directory)."
            )
        # The recipe alone does not name a model from init_from or hf_config (a directory outside the run):
        # the run records its config, so that eval and export rebuild the model that trained.
        self.recorded_config = model.config if m.init_from or getattr(m, "hf_config", None) else None
        if self.recorded_config is not None:
            self.recorded_config.architectures = [type(model).__name__]
        return model

    def flops_per_unit(self, model: torch.nn.Module) -> float | None:
        try:
            return transformer_flops_per_token(model, self.recipe.data.seq_len)
        except NotCounted as e:
            if self.rank == 0:
                log.warning("MFU is not logged: the FLOPs per token of this %s model are not counted: %s (docs/metrics.md)", self.recipe.model.kind, e)
            return None

    @classmethod
    def auto_class(cls, architecture: str | None) -> str:
        """The transformers Auto class that loads a saved model of this task whose class is `architecture`."""
        raise NotImplementedError

    def blocks(self, tokens):
        raise NotImplementedError

    forward_options: dict = {}  # keyword arguments of every forward the task runs

    @classmethod
    def loss(cls, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return model(**batch, **cls.forward_options).loss

    @classmethod
    def example_batch(cls, recipe, size: int) -> dict:
        ids = torch.zeros(size, recipe.data.seq_len, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}

    def validation_batches(self, max_batches: int | None):
        from zoa_train.data import validation_batches

        t = self.recipe.train
        return validation_batches(self.val_blocks, t.micro_batch_size, *self.val_layout, max_batches=max_batches)

    def metric_sums(self, model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        # Every rank runs the same number of equal batches: the mean of batch means is the mean.
        return {"val_loss": model(**batch, **self.forward_options).loss.float(), "count": torch.ones((), device=batch["input_ids"].device)}

    def save_artifacts(self, run_dir: Path) -> None:
        self.tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        if getattr(self, "recorded_config", None) is not None:
            self.recorded_config.save_pretrained(str(run_dir / MODEL_CONFIG))


class CausalLM(LanguageTask):
    name = "causal_lm"
    # Training needs no key/value cache; a block recomputed under train.activation_checkpointing would
    # otherwise append to it twice.
    forward_options = {"use_cache": False}

    @classmethod
    def auto_class(cls, architecture: str | None) -> str:
        return "AutoModelForCausalLM"

    def blocks(self, tokens):
        from zoa_train.data import CausalLMBlocks

        return CausalLMBlocks(tokens, self.recipe.data.seq_len)


class MaskedLM(LanguageTask):
    name = "masked_lm"

    @classmethod
    def auto_class(cls, architecture: str | None) -> str:
        return "AutoModelForPreTraining" if architecture and architecture.endswith("ForPreTraining") else "AutoModelForMaskedLM"

    @classmethod
    def example_batch(cls, recipe, size: int) -> dict:
        batch = super().example_batch(recipe, size)
        if recipe.model.next_sentence:
            batch |= {"token_type_ids": torch.zeros_like(batch["input_ids"]), "next_sentence_label": torch.zeros(size, dtype=torch.long)}
        return batch

    def blocks(self, tokens):
        from zoa_train.data import MaskedLMBlocks, SentencePairBlocks

        blocks = SentencePairBlocks if self.recipe.model.next_sentence else MaskedLMBlocks
        return blocks(tokens, self.recipe.data.seq_len, self.tokenizer)
