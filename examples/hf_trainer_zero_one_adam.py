"""A tiny GPT-2 trained with 0/1 Adam by Hugging Face Trainer (ZoaTrainer), on CPU or GPUs:

    torchrun --nproc_per_node 2 examples/hf_trainer_zero_one_adam.py --output-dir /tmp/zoa-hf

Random init (no download) on bytes of zoa-train's bundled corpus (Jane Austen). Every rank prints a
digest of its parameters at the end: ZoaTrainer ends on one model. Trainer's logs (and TensorBoard
or W&B with --report-to) carry bits_per_param, rounds and bytes_sent; continue a run with
--resume output-dir/checkpoint-N.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

from zoa_train.data.sources import bundled_paragraphs
from zoa_train.integrations.transformers import ZoaTrainer
from zoa_train.optim import OneBitAdam, ZeroOneAdam


def byte_blocks(block: int, count: int, skip: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` blocks of `block` bytes of the bundled corpus after the first `skip` blocks, as causal-LM
    examples (labels = inputs)."""
    text = "\n\n".join(bundled_paragraphs()).encode()[block * skip : block * (skip + count)]
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return [{"input_ids": ids, "labels": ids} for ids in data.view(count, block)]


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal on two ranks only if their models are identical."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode() + p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--optimizer", default="zero_one_adam", help="a zoa-train optimizer name: zero_one_adam, onebit_adam, diloco")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate on held-out text every this many steps (0: never)")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--own-optimizer", action="store_true", help="build the optimizer here and pass optimizers=(optimizer, None)")
    parser.add_argument("--resume", default=None, help="a checkpoint folder of an earlier run with the same settings")
    parser.add_argument("--report-to", default="none", help="Trainer's report_to: none, tensorboard, wandb")
    args = parser.parse_args(argv)

    set_seed(0)  # the same initial model on every rank (the optimizer also starts every rank from rank 0's)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    # Short warm-ups so that a run of a few dozen steps reaches 0/1 Adam's local steps (1-bit Adam's 1-bit phase).
    knobs = {
        "zero_one_adam": {"var_freeze_step": 4, "local_steps": "fixed", "local_step_interval": 4},
        "onebit_adam": {"freeze_step": 4},
    }.get(args.optimizer, {})
    if args.own_optimizer:  # built before TrainingArguments starts the process group: ZoaTrainer binds it to the group
        own = {"zero_one_adam": ZeroOneAdam, "onebit_adam": OneBitAdam}[args.optimizer](model.parameters(), lr=1e-3, **knobs)
        choice = {"optimizers": (own, None)}  # None: Trainer's scheduler from TrainingArguments
    else:  # by name, as a recipe names it: the registry's defaults for the knobs not given
        choice = {"zoa_optimizer": args.optimizer, "zoa_optimizer_kwargs": knobs}
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=4,
        save_steps=args.save_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=8,
        bf16=args.bf16,
        report_to=args.report_to,
        use_cpu=not torch.cuda.is_available(),  # on CPU accelerate takes torchrun's ranks only with it
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = ZoaTrainer(
        model=model,
        args=training,
        train_dataset=byte_blocks(block=64, count=1024),
        eval_dataset=byte_blocks(block=64, count=32, skip=1024),
        **choice,
    )
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model()  # the ranks' common model (ZoaTrainer synchronised them at the last step)
    trainer.save_state()  # trainer_state.json: log_history with bits_per_param at every log step
    print(f"rank {training.process_index}: parameter digest {parameter_digest(model)} on {model.device.type}", flush=True)
    if dist.is_initialized():  # Trainer leaves the group up; Gloo threads alive at interpreter exit can abort it
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
