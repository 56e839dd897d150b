"""SFT training throughput: astrai's Trainer vs transformers' Trainer vs a plain PyTorch loop.

All systems train the same tiny Llama-shaped model (astrai's CausalLM; transformers'
LlamaForCausalLM with the same config), in this process, with fused AdamW, clipping at 1.0 and
bf16 off, in two scenarios:

1. rows of one length (loss only on the "assistant" half): no padding anywhere, so this compares
   the loop and the model's arithmetic alone;
2. SFT examples of different lengths (prompt and reply drawn independently): what SFT data looks
   like. Both trainers run padded batches (each padded to its longest example) in random order
   and with their length-grouped order (`group_by_length`: batches of similar lengths); astrai
   also runs packed rows (`pack: true`, attention kept within each example). Throughput counts
   non-padding tokens only, over one epoch of the same examples; the ratio column compares
   astrai's grouped run with every row.
 Throughput
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

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


# -- scenario 2: SFT examples of different lengths ---------------------------------------------


def make_examples(num: int, vocab: int, max_part: int, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """(prompt, reply) token lists, each part 16..max_part tokens long."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, max_part + 1, (num, 2), generator=g).tolist()
    return [(torch.randint(0, vocab, (p,), generator=g).tolist(), torch.randint(0, vocab, (r,), generator=g).tolist())
            for p, r in lengths]


def run_astrai_ragged(args, examples, pack: bool, group: bool = False) -> tuple[float, float]:
    from astrai.config import load_config
    from astrai.data.datasets import SFTDataset
    from astrai.data.shards import RecordStore
    from astrai.model import CausalLM, ModelConfig
    from astrai.train.callbacks import CheckpointSaver
    from astrai.train.trainer import Trainer

    records = [{"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)} for p, r in examples]
    dataset = SFTDataset(RecordStore.from_records(records, args.vocab, {"train_type": "sft"}), args.pack_len, pack=pack)
    stamps: list[tuple[float, float]] = []
    seen: list[int] = []

    class Clock:
        def after_optimizer_step(self, trainer):
            stamps.append(now())
            seen.append(trainer.ctx.tokens_seen)  # non-padding input tokens so far

    batch = args.pack_rows if pack else args.batch
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, ["--train_type", "sft", "--batch_per_device", str(batch), "--n_epoch", "1",
                                 "--max_lr", "1e-3", "--schedule", "constant", "--log_dir", d, "--ckpt_dir", d,
                                 "--ckpt_interval", "0", "--progress", "false", "--max_seq_len", str(args.pack_len),
                                 "--group_by_length", str(group).lower()])
        model = CausalLM(ModelConfig(**model_kwargs(args)), seed=0)
        trainer = Trainer(cfg, model=model, train_dataset=dataset, callbacks=[Clock()])
        trainer.callbacks.callbacks = [c for c in trainer.callbacks.callbacks if not isinstance(c, CheckpointSaver)]
        trainer.train()
    return ragged_rates(stamps, [b - a for a, b in zip([0] + seen, seen)])


def ragged_rates(stamps: list[tuple[float, float]], step_tokens: list[int]) -> tuple[float, float]:
    """Real tokens of steps 2..S over the time from the end of step 1 to the end of step S."""
    tokens = sum(step_tokens[1:len(stamps)])
    return tokens / (stamps[-1][0] - stamps[0][0]), tokens / (stamps[-1][1] - stamps[0][1])


class PaddingCollator:
    """transformers' usual SFT batch: right-padded to the longest example, labels -100 on the
    prompt and the padding. Remembers the real tokens of every batch it builds, in order."""

    def __init__(self):
        self.batch_tokens: list[int] = []

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        T = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), T, dtype=torch.long)
        labels = torch.full((len(samples), T), IGNORE)
        mask = torch.zeros(len(samples), T, dtype=torch.long)
        for b, s in enumerate(samples):
            n, p = len(s["input_ids"]), s["prompt_len"]
            ids[b, :n] = torch.tensor(s["input_ids"])
            labels[b, p:n] = ids[b, p:n]
            mask[b, :n] = 1
        self.batch_tokens.append(int(mask.sum()))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_hf_trainer_ragged(args, examples, group_by_length: bool) -> tuple[float, float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    stamps: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(now())

    data = [{"input_ids": p + r, "prompt_len": len(p)} for p, r in examples]
    collator = PaddingCollator()
    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(
            output_dir=d, per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=1e-3,
            lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused", save_strategy="no",
            report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
            remove_unused_columns=False,
            train_sampling_strategy="group_by_length" if group_by_length else "random",
        )
        trainer = Trainer(model=hf_model(args), args=targs, train_dataset=data, data_collator=collator,
                          callbacks=[Clock()])
        trainer.train()
    return ragged_rates(stamps, collator.batch_tokens)


def run_plain_loop_ragged(args, examples) -> tuple[float, float]:
    model = hf_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = [{"input_ids": p + r, "prompt_len": len(p)} for p, r in examples]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    collator = PaddingCollator()
    stamps: list[tuple[float, float]] = []
    for start in range(0, len(order), args.batch):
        loss = model(**collator([data[i] for i in order[start:start + args.batch]])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(now())
    return ragged_rates(stamps, collator.batch_tokens)


# -- driver ---------------------------------------------------------------------------------------


def measure(systems: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median (wall, CPU) rates per system; systems run interleaved, so drift in machine load hits
    every system alike."""
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            results[name].append(fn())
    wall = {name: statistics.median(r[0] for r in v) for name, v in results.items()}
    cpu = {name: statistics.median(r[1] for r in v) for name, v in results.items()}
    return wall, cpu


def print_table(title: str, ours: str, wall: dict[str, float], cpu: dict[str, float]) -> None:
    print(f"\n{title}\n")
    print(f"| system | tokens/CPU-s | {ours} / system | tokens/s (wall) | {ours} / system |")
    print("|---|---:|---:|---:|---:|")
    for name in wall:
        print(f"| {name} | {cpu[name]:,.0f} | {cpu[ours] / cpu[name]:.2f}x | {wall[name]:,.0f} | "
              f"{wall[ours] / wall[name]:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run (fewer steps and repeats)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="fixed-length scenario: optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="examples per batch (padded batches)")
    p.add_argument("--seq_len", type=int, default=128, help="fixed-length scenario: tokens per row")
    p.add_argument("--examples", type=int, default=256, help="ragged scenario: SFT examples (one epoch)")
    p.add_argument("--max_part", type=int, default=96, help="ragged scenario: longest prompt or reply")
    p.add_argument("--pack_len", type=int, default=256, help="ragged scenario: astrai's packed row length")
    p.add_argument("--pack_rows", type=int, default=4, help="ragged scenario: packed rows per batch")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in all three systems")
    p.add_argument("--scenario", choices=["fixed", "ragged", "both"], default="both")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.examples = 3, 8, 64
    torch.set_num_threads(args.threads)
    shape = f"model hidden={args.hidden} layers={args.layers} vocab={args.vocab}, CPU ({args.threads} thread(s))"

    if args.scenario in ("fixed", "both"):
        rows = make_rows(args.batch * args.steps, args.seq_len, args.vocab)
        wall, cpu = measure({
            "astrai Trainer": lambda: run_astrai(args, rows),
            "transformers Trainer": lambda: run_hf_trainer(args, rows),
            "plain PyTorch loop (transformers model)": lambda: run_plain_loop(args, rows),
        }, args.repeats)
        print_table(f"SFT training throughput, rows of one length: {shape}, batch {args.batch} x {args.seq_len} "
                    f"tokens, {args.steps} steps, median of {args.repeats}{', torch.compile' if args.compile else ''}",
                    "astrai Trainer", wall, cpu)

    if args.scenario in ("ragged", "both"):
        examples = make_examples(args.examples, args.vocab, args.max_part)
        wall, cpu = measure({
            "astrai Trainer, group_by_length": lambda: run_astrai_ragged(args, examples, pack=False, group=True),
            "astrai Trainer, padded": lambda: run_astrai_ragged(args, examples, pack=False),
            "astrai Trainer, packed": lambda: run_astrai_ragged(args, examples, pack=True),
            "transformers Trainer, padded": lambda: run_hf_trainer_ragged(args, examples, group_by_length=False),
            "transformers Trainer, group_by_length": lambda: run_hf_trainer_ragged(args, examples, True),
            "plain PyTorch loop (transformers model), padded": lambda: run_plain_loop_ragged(args, examples),
        }, args.repeats)
        print_table(f"SFT training throughput, examples of different lengths (prompt and reply 16-{args.max_part} "
                    f"tokens each, loss on the reply): {shape}; one epoch of {args.examples} examples; padded: "
                    f"{args.batch} examples per batch; packed: {args.pack_rows} rows of {args.pack_len} tokens; "
                    f"non-padding tokens, median of {args.repeats}", "astrai Trainer, group_by_length", wall, cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
