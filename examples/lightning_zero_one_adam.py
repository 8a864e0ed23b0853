"""0/1 Adam (or 1-bit Adam) in PyTorch Lightning with zoa-train's SelfSyncingStrategy: a tiny GPT-2
(random init) learning the bytes of zoa-train's bundled corpus, offline (on CPU; `--accelerator gpu`: a GPU per process).

    python examples/lightning_zero_one_adam.py --devices 2          # Lightning starts the 2 processes
    torchrun --nproc-per-node 2 examples/lightning_zero_one_adam.py  # or torchrun does

It checkpoints at the end of every epoch (OUT/checkpoints), logs to OUT/metrics.csv (CSVLogger:
loss and what the optimizer sent) and, at the end, has every rank write its parameters to
OUT/rank<R>.pt. `--resume OUT/checkpoints/epoch=0.ckpt` continues a run exactly.
"""

import argparse
import lzma
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from zoa_train.integrations.lightning import SelfSyncingStrategy
from zoa_train.optim import OneBitAdam, ZeroOneAdam

CORPUS = Path(__file__).resolve().parents[1] / "zoa_train" / "data" / "corpus" / "austen.txt.xz"

# Small warm-ups so that a run of a few dozen steps reaches the 1-bit phase (and 0/1 Adam's local steps).
OPTIMIZERS = {
    "zero_one_adam": lambda params, lr: ZeroOneAdam(params, lr=lr, var_freeze_step=4, local_steps="fixed", local_step_interval=4),
    "onebit_adam": lambda params, lr: OneBitAdam(params, lr=lr, freeze_step=4),
}


def byte_blocks(count: int, length: int) -> torch.Tensor:
    """`count` blocks of `length` consecutive bytes of the corpus (vocabulary: the 256 byte values)."""
    data = lzma.decompress(CORPUS.read_bytes())[: count * length]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long().view(count, length)


class TinyGPT2(pl.LightningModule):
    """A 2-layer GPT-2 with 32-wide embeddings, no dropout (so a resumed run repeats an uninterrupted one)."""

    def __init__(self, optimizer: str = "zero_one_adam", lr: float = 1e-3, seq_len: int = 32):
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=256,
            n_positions=seq_len,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=None,
            eos_token_id=None,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        (tokens,) = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def on_train_end(self):
        # Lightning moves the module back to the CPU when it tears down: say where it trained.
        print(f"rank {self.global_rank}: trained on {self.device.type}", flush=True)

    def configure_optimizers(self):
        return OPTIMIZERS[self.hparams.optimizer](self.parameters(), self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="zero_one_adam")
    parser.add_argument("--out", type=Path, default=Path("lightning_zero_one_adam"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=128, help="training blocks (split over the ranks)")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val (each rank's own gradient norm)")
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="gpu: one GPU per process (NCCL)")
    parser.add_argument("--resume", help="a checkpoint this script wrote")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    seq_len = 32
    blocks = byte_blocks(args.samples + 16, seq_len)
    train = DataLoader(TensorDataset(blocks[: args.samples]), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(blocks[args.samples :]), batch_size=args.batch_size)
    trainer = pl.Trainer(
        strategy=SelfSyncingStrategy(),
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.epochs,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        logger=CSVLogger(args.out, name="", version=""),
        log_every_n_steps=1,
        callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", filename="{epoch}", save_top_k=-1, every_n_epochs=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = TinyGPT2(args.optimizer, seq_len=seq_len)
    trainer.fit(module, train, val, ckpt_path=args.resume)
    # Every rank's own parameters: SelfSyncingStrategy leaves them identical at the end of training.
    torch.save({n: p.detach().clone() for n, p in module.named_parameters()}, args.out / f"rank{trainer.global_rank}.pt")
    if trainer.is_global_zero:
        print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})
    if dist.is_initialized():  # Lightning leaves the group up; Gloo threads alive at interpreter exit can abort it
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
