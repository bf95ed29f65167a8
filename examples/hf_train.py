"""A Hugging Face Trainer script, fault tolerant under ftrun through one changed name:
`FaultTolerantTrainer(...)` instead of `Trainer(...)`.

    ftrun --nproc 2 --spares 1 examples/hf_train.py --epochs 2
    python examples/hf_train.py                      # alone: transformers.Trainer
    torchrun --nproc-per-node 2 examples/hf_train.py # Accelerate's own DDP

A tiny GPT-2 built from a config (nothing is downloaded) learns a synthetic token task: each
sequence counts up from a random start, modulo the vocabulary. Dropout, AdamW, a linear
schedule with warmup, gradient clipping, an evaluation each epoch. `--out DIR` writes each
worker's final parameters (params_<worker>.pt) and every step it finished
(log_<worker>.json: global step, epoch, and how many steps it ran again).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Dataset

# before TrainingArguments: under ftrun it keeps Accelerate to one process per worker
from ftrun.integrations.transformers import FaultTolerantTrainer  # isort: skip
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments


class CountingTokens(Dataset):
    def __init__(self, samples: int, length: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(1)
        starts = torch.randint(0, vocab, (samples, 1), generator=gen)
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepLog(TrainerCallback):
    """Every step this worker finished, for the fault tests and the benchmark."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rows.append({"step": state.global_step, "epoch": round(state.epoch, 6),
                          "t": time.time()})


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--batch", type=int, default=8, help="per worker")
    ap.add_argument("--length", type=int, default=16)
    ap.add_argument("--embd", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ckpt-dir", help="a checkpoint every step, and resume from the last one "
                    "(how torchrun's restart recovers: scripts/bench/bench_integrations.py)")
    ap.add_argument("--out", help="final parameters and the step log of every worker")
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=64, n_positions=args.length, n_embd=args.embd,
                        n_layer=args.layers, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = CountingTokens(args.samples, args.length, config.vocab_size)
    log = StepLog()
    with tempfile.TemporaryDirectory() as scratch:
        saving: dict[str, Any] = {"save_strategy": "no"}
        if args.ckpt_dir:
            saving = {"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1}
        training = TrainingArguments(
            output_dir=args.ckpt_dir or scratch, num_train_epochs=args.epochs, learning_rate=3e-3,
            per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
            warmup_steps=3, lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.01,
            eval_strategy="epoch", logging_strategy="no", report_to=[], use_cpu=True, seed=0,
            dataloader_drop_last=True, disable_tqdm=True, **saving)
        trainer = FaultTolerantTrainer(model=model, args=training, train_dataset=data,
                                       eval_dataset=CountingTokens(32, args.length, 64),
                                       callbacks=[log])
        resume = bool(args.ckpt_dir) and any(
            name.startswith("checkpoint-") for name in os.listdir(args.ckpt_dir))
        trainer.train(resume_from_checkpoint=True if resume else None)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        wid = os.environ.get("FTRUN_WORKER_ID", os.environ.get("RANK", "0"))
        torch.save(model.state_dict(), os.path.join(args.out, f"params_{wid}.pt"))
        with open(os.path.join(args.out, f"log_{wid}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "rows": log.rows,
                       "repeats": getattr(trainer, "repeats", 0)}, f)


if __name__ == "__main__":
    main()
