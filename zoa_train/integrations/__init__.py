"""zoa-train's optimizers where users already train: Hugging Face Trainer and accelerate
(`zoa_train.integrations.transformers`), Lightning (`zoa_train.integrations.lightning`), and a way
over from DeepSpeed configs (`zoa_train.integrations.deepspeed`). Each framework is an optional extra;
nothing here is imported by the core package."""
