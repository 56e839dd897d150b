"""SFT training throughput: astrai's Trainer vs transformers' Trainer vs a plain PyTorch loop.

All three train the same tiny Llama-shaped model (astrai's CausalLM; transformers'
LlamaForCausalLM with the same config) on the same synthetic SFT rows (fixed length, loss only on
the "assistant" half), in this process, with fused AdamW, clipping at 1.0 and bf16 off. Throughput
is measured from the end of the first optimizer step to the end of the last (steady state, setup
excluded) and counts input tokens, both per wall-clock second and per second of process CPU time
(the second is the robust figure on a shared machine: time spent waiting for a core is not
counted). One intra-op thread by default, so CPU time is not inflated by spinning OpenMP workers.
Systems run interleaved; the table shows medians and the ratio of astrai to each peer.

    .venv/bin/python benchmarks/bench_train.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

IGNORE = -100


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def rates(stamps: list[tuple[float, float]], tokens_per_step: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second) between the first and the last stamp."""
    tokens = (len(stamps) - 1) * tokens_per_step
    return tokens / (stamps[-1][0] - stamps[0][0]), tokens / (stamps[-1][1] - stamps[0][1])


def make_rows(num_rows: int, seq_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_rows, seq_len + 1), generator=g).tolist()


class AstraiSFTRows:
    """astrai's batch layout: labels already shifted, -100 on the prompt half."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> list[int]:
        return self.rows[i]

    def collate(self, samples: list[list[int]]) -> dict[str, torch.Tensor]:
        ids = torch.tensor(samples)  # (B, T + 1)
        input_ids, labels = ids[:, :-1].clone(), ids[:, 1:].clone()
        labels[:, : labels.size(1) // 2] = IGNORE
        B, T = input_ids.shape
        return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones(B, T, dtype=torch.long),
                "position_ids": torch.arange(T).expand(B, T).clone()}


def hf_collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """transformers' layout: unshifted labels (the model shifts), -100 on the prompt half."""
    ids = torch.tensor([s["input_ids"] for s in samples])  # (B, T)
    labels = ids.clone()
    labels[:, : ids.size(1) // 2 + 1] = IGNORE
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def model_kwargs(args) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=args.seq_len * 2, tie_word_embeddings=False)


def run_astrai(args, rows) -> tuple[float, float]:
    from astrai.config import load_config
    from astrai.model import CausalLM, ModelConfig
    from astrai.train.callbacks import CheckpointSaver
    from astrai.train.trainer import Trainer

    stamps: list[tuple[float, float]] = []

    class Clock:
        def after_optimizer_step(self, trainer):
            stamps.append(now())

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, ["--train_type", "sft", "--batch_per_device", str(args.batch), "--max_steps",
                                 str(args.steps), "--max_lr", "1e-3", "--schedule", "constant", "--log_dir", d,
                                 "--ckpt_dir", d, "--ckpt_interval", "0", "--progress", "false",
                                 "--compile", str(args.compile).lower()])
        model = CausalLM(ModelConfig(**model_kwargs(args)), seed=0)
        trainer = Trainer(cfg, model=model, train_dataset=AstraiSFTRows(rows), callbacks=[Clock()])
        trainer.callbacks.callbacks = [c for c in trainer.callbacks.callbacks if not isinstance(c, CheckpointSaver)]
        trainer.train()
    return rates(stamps, args.batch * args.seq_len)


def hf_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**model_kwargs(args), rms_norm_eps=1e-6)
    return LlamaForCausalLM(cfg)


def run_hf_trainer(args, rows) -> tuple[float, float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    stamps: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(now())

    data = [{"input_ids": r[:-1]} for r in rows]
    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(
            output_dir=d, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-3,
            lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused", save_strategy="no",
            report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
            remove_unused_columns=False, torch_compile=args.compile,
        )
        trainer = Trainer(model=hf_model(args), args=targs, train_dataset=data, data_collator=hf_collate,
                          callbacks=[Clock()])
        trainer.train()
    return rates(stamps, args.batch * args.seq_len)


def run_plain_loop(args, rows) -> tuple[float, float]:
    model = hf_model(args)
    if args.compile:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    stamps: list[tuple[float, float]] = []
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows), generator=g).tolist()
    for step in range(args.steps):
        idx = order[(step * args.batch) % len(rows):][: args.batch]
        batch = hf_collate([{"input_ids": rows[i][:-1]} for i in idx])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(now())
    return rates(stamps, args.batch * args.seq_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run (fewer steps and repeats)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in all three systems")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 3, 8
    torch.set_num_threads(args.threads)
    rows = make_rows(args.batch * args.steps, args.seq_len, args.vocab)
    systems = {"astrai Trainer": run_astrai, "transformers Trainer": run_hf_trainer,
               "plain PyTorch loop (transformers model)": run_plain_loop}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for _ in range(args.repeats):  # interleaved: drift in machine load hits every system alike
        for name, fn in systems.items():
            results[name].append(fn(args, rows))
    wall = {name: statistics.median(r[0] for r in v) for name, v in results.items()}
    cpu = {name: statistics.median(r[1] for r in v) for name, v in results.items()}
    ours_wall, ours_cpu = wall["astrai Trainer"], cpu["astrai Trainer"]
    print(f"\nSFT training throughput, CPU ({args.threads} thread(s)), model hidden={args.hidden} "
          f"layers={args.layers} vocab={args.vocab}, batch {args.batch} x {args.seq_len} tokens, "
          f"{args.steps} steps, median of {args.repeats}{', torch.compile' if args.compile else ''}\n")
    print("| system | tokens/CPU-s | astrai / system | tokens/s (wall) | astrai / system |")
    print("|---|---:|---:|---:|---:|")
    for name in systems:
        print(f"| {name} | {cpu[name]:,.0f} | {ours_cpu / cpu[name]:.2f}x | {wall[name]:,.0f} | "
              f"{ours_wall / wall[name]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
