"""A tiny GPT-2 trained with 0/1 Adam in a plain accelerate loop, on CPU or GPUs:

    torchrun --nproc_per_node 2 examples/accelerate_zero_one_adam.py
    accelerate launch --num_processes 2 examples/accelerate_zero_one_adam.py
    torchrun --nproc_per_node 2 examples/accelerate_zero_one_adam.py --overlap --accumulation 2

The pattern: prepare the data loader, optimizer and scheduler, not the model (0/1 Adam does its own
data-parallel communication; DDP would average every gradient on top of it). Random init (no
download) on bytes of zoa-train's bundled corpus. Every rank prints a digest of its parameters at
the end: after `synchronize()` the ranks hold one model. With --overlap the optimizer starts each
bucket's round during backward (docs/algorithm.md, "Overlap"); the micro-batches before the last run
under its no_sync(), which accelerate's accumulate() cannot give a model that is not DDP.
"""

import argparse
import contextlib
import hashlib

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from zoa_train.comm import ClusterCollective
from zoa_train.data.sources import bundled_paragraphs
from zoa_train.integrations.transformers import build_optimizer, prepare_accelerate


def byte_blocks(block: int, count: int) -> torch.Tensor:
    """`count` blocks of `block` bytes of the bundled corpus, one block a row."""
    data = torch.frombuffer(bytearray("\n\n".join(bundled_paragraphs()).encode()[: block * count]), dtype=torch.uint8).long()
    return data.view(count, block)


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal on two ranks only if their models are identical."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode() + p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--overlap", action="store_true", help="start the 1-bit rounds during backward")
    args = parser.parse_args(argv)

    # Starts the process group (gloo on CPU, nccl on GPUs) before the optimizer, which reads its size.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.accumulation, mixed_precision=args.mixed_precision)
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    model.to(accelerator.device)
    # 0/1 Adam by its recipe name and knobs (the registry's defaults for the rest); short warm-up and
    # a sync every 4 steps so that a few dozen steps reach the local steps.
    collective = ClusterCollective(overlap=True, bucket_cap_mb=0.05) if args.overlap else None  # small buckets: a small model
    zoa = build_optimizer(model, "zero_one_adam", collective, lr=1e-3, var_freeze_step=4, local_steps="fixed", local_step_interval=4).optimizer
    loader = DataLoader(byte_blocks(block=64, count=2048), batch_size=8, shuffle=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(zoa, lambda step: 1.0)
    model, optimizer, loader, scheduler = prepare_accelerate(accelerator, model, zoa, loader, scheduler)

    model.train()
    step, logged = 0, (0, 0)
    while step < args.steps:
        for ids in loader:
            with accelerator.accumulate(model), contextlib.nullcontext() if accelerator.sync_gradients else zoa.no_sync():
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                optimizer.step()  # steps once every `accumulation` batches; communicates itself
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % 4 == 0:
                ledger = zoa.ledger  # what the optimizer sent (zoa_train.comm.CommLedger)
                window = (ledger.payload_bits - logged[1]) / (ledger.num_params * (ledger.steps - logged[0]))
                logged = (ledger.steps, ledger.payload_bits)
                accelerator.print(
                    f"step {step} loss {loss.item():.3f} bits_per_param {ledger.average_bits_per_param:.3f} "
                    f"window_bits_per_param {window:.3f} rounds {ledger.rounds} bytes_sent {ledger.bytes_sent}"
                )
            if step == args.steps:
                break
    zoa.synchronize()  # end 0/1 Adam's pending local steps: every rank holds the same model
    trained = accelerator.unwrap_model(model)
    print(f"rank {accelerator.process_index}: parameter digest {parameter_digest(trained)} on {trained.device.type}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
