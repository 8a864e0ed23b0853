"""Model builders: GPT-2 and BERT through transformers, ResNets through torchvision; nothing is downloaded."""

from zoa_train.models.builders import MODEL_PRESETS, RESNETS, ModelConfig, build_bert, build_gpt2, build_resnet, model_shape

__all__ = ["MODEL_PRESETS", "RESNETS", "ModelConfig", "build_bert", "build_gpt2", "build_resnet", "model_shape"]
