"""A plain Lightning script, fault tolerant under ftrun through one argument:
`Trainer(strategy=FaultTolerantStrategy(), ...)`.

    ftrun --nproc 2 --spares 1 examples/lightning_train.py --epochs 3
    python examples/lightning_train.py --devices 2          # Lightning's own DDP launcher
    torchrun --nproc-per-node 2 examples/lightning_train.py

A small MLP with dropout on a synthetic regression task, SGD with momentum, a step LR
schedule, gradient clipping, a validation pass each epoch. `--out DIR` writes each worker's
final parameters (params_<worker>.pt) and a log of every training batch it finished
(log_<worker>.json: global step, epoch, batch index, loss, and how many steps it ran again).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ftrun.integrations.lightning import FaultTolerantStrategy


class Regressor(L.LightningModule):
    def __init__(self, dim: int, hidden: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(L.LightningDataModule):
    def __init__(self, samples: int, dim: int, batch: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(samples, dim, generator=gen)
        y = (x.sin().sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=gen))
        self.train_set = TensorDataset(x, y)
        self.val_set = TensorDataset(x[: samples // 4], y[: samples // 4])
        self.batch = batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch)


class BatchLog(L.Callback):
    """Every training batch this worker finished, for the fault tests and the benchmark."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule,
                           outputs: object, batch: object, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append({"step": trainer.global_step, "epoch": trainer.current_epoch,
                          "batch": batch_idx, "loss": float(loss),  # type: ignore[arg-type]
                          "rank": trainer.global_rank, "t": time.time()})


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ddp", action="store_true", help="Lightning's own DDPStrategy instead")
    ap.add_argument("--ckpt-dir", help="a checkpoint every step, and resume from the last one "
                    "(how torchrun's restart recovers: scripts/bench/bench_integrations.py)")
    ap.add_argument("--out", help="final parameters and the batch log of every worker")
    return ap.parse_args()


def main() -> None:
    args = parse()
    L.seed_everything(0)  # the same initial weights on every rank
    model = Regressor(args.dim, args.hidden, args.lr)
    strategy = "ddp" if args.ddp else FaultTolerantStrategy()
    log = BatchLog()
    callbacks: list[L.Callback] = [log]
    last = None
    if args.ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=args.ckpt_dir, every_n_train_steps=1, save_last=True))
        last = os.path.join(args.ckpt_dir, "last.ckpt")
    trainer = L.Trainer(strategy=strategy, devices=args.devices, accelerator="cpu",
                        max_epochs=args.epochs, gradient_clip_val=1.0, limit_val_batches=2,
                        num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=bool(args.ckpt_dir), enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, datamodule=Data(args.samples, args.dim, args.batch),
                ckpt_path=last if last and os.path.exists(last) else None)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        wid = os.environ.get("FTRUN_WORKER_ID", str(trainer.global_rank))
        torch.save(model.state_dict(), os.path.join(args.out, f"params_{wid}.pt"))
        with open(os.path.join(args.out, f"log_{wid}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "rows": log.rows,
                       "repeats": getattr(trainer.strategy, "repeats", 0)}, f)


if __name__ == "__main__":
    main()
