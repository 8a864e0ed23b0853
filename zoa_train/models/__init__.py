"""Model builders: GPT-2 and BERT through transformers, from presets, without any download."""

from zoa_train.models.builders import MODEL_PRESETS, build_model

__all__ = ["MODEL_PRESETS", "build_model"]
