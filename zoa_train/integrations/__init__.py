"""zoa-train's optimizers where users already train: Hugging Face Trainer and accelerate
(`zoa_train.integrations.transformers`) and Lightning (`zoa_train.integrations.lightning`). Each
framework is an optional extra; nothing here is imported by the core package (tests/test_layering.py).
The way over from DeepSpeed configs is a core command: `zoa_train.convert_deepspeed`."""
