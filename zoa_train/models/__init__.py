"""Model builders: GPT-2 and BERT through transformers, ResNets through torchvision; nothing is downloaded."""

from zoa_train.models.builders import MODEL_PRESETS, RESNETS, build_bert, build_gpt2, build_resnet

__all__ = ["MODEL_PRESETS", "RESNETS", "build_bert", "build_gpt2", "build_resnet"]
