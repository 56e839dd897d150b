"""SFT and DPO training throughput: astrai's Trainer against transformers' Trainer, TRL's
SFTTrainer and DPOTrainer (and a plain PyTorch loop), side by side.

Every system trains the same model in this process, with fused AdamW, clipping at 1.0 and bf16
off: the tiny Llama shape below (astrai's CausalLM; transformers' LlamaForCausalLM with the same
config), and each model directory given to `--model` (e.g. `.cache/smollm2` after `make
real-model`: astrai's `load_model` and transformers' `from_pretrained` of the same weights).
Scenarios:

1. `fixed` (tiny model only): rows of one length, loss on the second half: no padding anywhere,
   so this compares the loop and the model's arithmetic alone (against the Trainer and a loop).
2. `sft`: one epoch of chats whose prompt and reply lengths are spread log-normally as in chat
   data (medians 48 and 96 tokens), loss on the reply: astrai's default `row_layout` and its other
   layouts (`flat`, `pack`, `pad`; `pad` also with `group_by_length`), the transformers Trainer (padded, random and
   `group_by_length`), TRL's SFTTrainer padded and `padding_free` (a flat row, positions
   restarting per chat; the same token ids, pre-tokenized).
3. `dpo`: one epoch of preference pairs (a prompt, two replies of independent lengths) as text,
   tokenized as TRL's DPOTrainer does: astrai's `dpo` in its default layout and padded, and TRL's
   DPOTrainer (its `padding_free` is disabled in TRL 1.x), beta 0.1, each with a frozen reference.

Throughput is measured from the end of the first optimizer step to the end of the last (steady
state, setup excluded) and counts non-padding input tokens, both per wall-clock second and per
second of process CPU time (the robust figure on a shared machine: time spent waiting for a core
is not counted). MFU: model FLOPs per token (6 x the parameters that multiply, 8 x for DPO's extra
reference forward) x tokens per wall second, over this machine's float32 matrix-product rate
measured at the same thread count (the better of PyTorch's default BLAS and oneDNN). One intra-op
thread by default. Systems run interleaved; the tables show medians and the ratio of astrai's
default to each row; under each, the issue's table: the default against each peer at its best
setting, with the target ratio.

The matrix-product library: astrai sends float32 CPU products to oneDNN (`train.cpu_matmul auto`),
process-wide, while transformers and TRL run on PyTorch's default (MKL's sgemm on x86). Every peer
row switches the process back to that default before it runs (`set_cpu_matmul("blas")`); a row
marked "astrai's oneDNN products" gives the peer astrai's routing instead, to separate what the
library does from what the framework does. The targets are met or not against the peer's own rows.
TRL 1.x turns gradient checkpointing on by default (`SFTConfig`, `DPOConfig`); its rows turn it off,
its faster setting (the memory is there), as every other system runs without it.

    .venv/bin/python benchmarks/bench_train.py [--quick] [--model tiny .cache/smollm2] [--threads 2]
    .venv/bin/python benchmarks/bench_train.py --model tiny --scenario sft dpo --threads 2
    .venv/bin/python benchmarks/bench_train.py --model .cache/smollm2 --scenario sft dpo --threads 2
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

IGNORE = -100
ONEDNN = "astrai's oneDNN products"


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
                max_position_embeddings=2 * max(args.seq_len, args.max_len), tie_word_embeddings=False)


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


# -- scenario 2: chat SFT and DPO, lengths spread as in chat data ------------------------------


def word_tokenizer(vocab: int, out: Path):
    """A transformers tokenizer whose words w0 .. w{vocab-4} are one token each (ids 3..), so a
    text of n words is n tokens: TRL's trainers need a tokenizer, and the tiny model has none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(vocab - 3)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def chat_lengths(num: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, reply) token counts of `num` chats, log-normally spread as in chat SFT data
    (medians 48 and 96 tokens, a long tail), each chat cut to `max_len` tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt = (torch.randn(num, generator=g) * 0.8 + math.log(48)).exp().clamp(4, max_len // 2)
    reply = (torch.randn(num, generator=g) * 0.8 + math.log(96)).exp().clamp(4, max_len)
    out = []
    for p, r in zip(prompt.long().tolist(), reply.long().tolist()):
        out.append((p, max(1, min(r, max_len - p))))
    return out


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def make_chats(args, vocab: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [(random_ids(p, vocab, g), random_ids(r, vocab, g)) for p, r in chat_lengths(args.examples, args.max_len, 2)]


def make_pairs(args, tokenizer) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) texts: a prompt and two replies of independent lengths, decoded
    from random token ids (TRL's DPOTrainer reads text; each reply starts with a space, since TRL
    tokenizes prompt + reply as one string)."""
    g = torch.Generator().manual_seed(3)
    vocab = min(len(tokenizer), tokenizer.vocab_size)
    text = lambda n: tokenizer.decode(random_ids(n, vocab, g), skip_special_tokens=True)  # noqa: E731
    lengths = chat_lengths(2 * args.pairs, args.max_len, 4)
    return [(text(p), " " + text(c), " " + text(min(r, args.max_len - p)))
            for (p, c), (_, r) in zip(lengths[::2], lengths[1::2])]


def pair_records(pairs, tokenizer) -> list[dict[str, list[int]]]:
    """astrai's DPO records of the pairs, tokenized as TRL's DPOTrainer does: the prompt, and
    prompt + reply as one string, then the end-of-sequence token."""
    records = []
    for prompt, chosen, rejected in pairs:
        p = len(tokenizer(prompt)["input_ids"])
        record = {}
        for side, reply in (("chosen", chosen), ("rejected", rejected)):
            ids = tokenizer(prompt + reply)["input_ids"] + [tokenizer.eos_token_id]
            record.update({f"{side}_input_ids": ids, f"{side}_loss_mask": [0] * p + [1] * (len(ids) - p)})
        records.append(record)
    return records


class Counting:
    """A collate function wrapped to count each batch's real (non-padding) input tokens."""

    def __init__(self, collate):
        self.collate, self.batch_tokens = collate, []

    def __call__(self, samples):
        batch = self.collate(samples)
        masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
        self.batch_tokens.append(int(sum(m.sum() for m in masks)) if masks else int(batch["input_ids"].numel()))
        return batch


def astrai_model(args):
    from astrai import load_model
    from astrai.model import CausalLM, ModelConfig

    if args.model_dir:
        return load_model(args.model_dir, dtype=torch.float32)
    return CausalLM(ModelConfig(**model_kwargs(args)), seed=0)


def hf_pretrained(args):
    if not args.model_dir:
        return hf_model(args)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)


def run_astrai_chat(args, chats, layout: str, group: bool = False, train_type: str = "sft") -> tuple[float, float]:
    """astrai's Trainer over one epoch of `chats`: (prompt, reply) ids for SFT, ``pair_records``
    for ``train_type`` dpo."""
    from astrai.config import load_config
    from astrai.data.datasets import DPODataset, SFTDataset
    from astrai.data.shards import RecordStore
    from astrai.train.callbacks import CheckpointSaver
    from astrai.train.trainer import Trainer

    model = astrai_model(args)
    vocab = model.config.vocab_size
    if train_type == "sft":
        records = [{"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)} for p, r in chats]
        dataset = SFTDataset(RecordStore.from_records(records, vocab, {"train_type": "sft"}), args.max_len)
    else:  # chats: pair_records
        dataset = DPODataset(RecordStore.from_records(chats, vocab, {"train_type": "dpo"}), 2 * args.max_len)
    stamps: list[tuple[float, float]] = []
    seen: list[int] = []

    class Clock:
        def after_optimizer_step(self, trainer):
            stamps.append(now())
            seen.append(trainer.ctx.tokens_seen)  # non-padding input tokens so far

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, ["--train_type", train_type, "--batch_per_device", str(args.batch), "--n_epoch", "1",
                                 "--max_lr", "1e-5", "--schedule", "constant", "--warmup_ratio", "0", "--log_dir", d,
                                 "--ckpt_dir", d, "--ckpt_interval", "0", "--progress", "false", "--max_seq_len",
                                 str(args.max_len + 1 if train_type == "sft" else 2 * args.max_len), "--group_by_length", str(group).lower(), "--row_layout", layout])
        trainer = Trainer(cfg, model=model, train_dataset=dataset, callbacks=[Clock()])
        trainer.callbacks.callbacks = [c for c in trainer.callbacks.callbacks if not isinstance(c, CheckpointSaver)]
        trainer.train()
    return ragged_rates(stamps, [b - a for a, b in zip([0] + seen, seen)])


class HFClock:
    """A TrainerCallback stamping every optimizer step."""

    def __new__(cls, stamps):
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def on_step_end(self, a, state, control, **kw):
                stamps.append(now())

        return Clock()


def run_hf_trainer_chat(args, chats, group_by_length: bool) -> tuple[float, float]:
    from transformers import Trainer, TrainingArguments

    stamps: list[tuple[float, float]] = []
    data = [{"input_ids": p + r, "prompt_len": len(p)} for p, r in chats]
    collator = PaddingCollator()
    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(
            output_dir=d, per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=1e-5,
            lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused", save_strategy="no",
            report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
            remove_unused_columns=False, train_sampling_strategy="group_by_length" if group_by_length else "random",
        )
        Trainer(model=hf_pretrained(args), args=targs, train_dataset=data, data_collator=collator,
                callbacks=[HFClock(stamps)]).train()
    return ragged_rates(stamps, collator.batch_tokens)


def run_trl_sft(args, chats, tokenizer, padding_free: bool) -> tuple[float, float]:
    """TRL's SFTTrainer on the same token ids (a pre-tokenized dataset, loss on the reply only),
    padded to each batch's longest or `padding_free` (one flat row, positions restarting per chat)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    stamps: list[tuple[float, float]] = []
    data = datasets.Dataset.from_list([{"input_ids": p + r, "completion_mask": [0] * len(p) + [1] * len(r)}
                                       for p, r in chats])
    with tempfile.TemporaryDirectory() as d:
        config = SFTConfig(output_dir=d, per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=1e-5,
                           lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused",
                           save_strategy="no", report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True,
                           dataloader_num_workers=0, completion_only_loss=True, padding_free=padding_free,
                           gradient_checkpointing=False,  # TRL 1.x's default is on: slower, less memory
                           max_length=None if padding_free else args.max_len + 1, bf16=False)  # chats are shorter
        trainer = SFTTrainer(model=hf_pretrained(args), args=config, train_dataset=data, processing_class=tokenizer,
                             callbacks=[HFClock(stamps)])
        trainer.data_collator = collator = Counting(trainer.data_collator)
        trainer.train()
    return ragged_rates(stamps, collator.batch_tokens)


def run_trl_dpo(args, pairs, tokenizer) -> tuple[float, float]:
    """TRL's DPOTrainer on the same pairs (``make_pairs``), beta 0.1, sigmoid loss, a frozen copy of
    the model as reference, like astrai's ``dpo``."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    stamps: list[tuple[float, float]] = []
    data = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs])
    with tempfile.TemporaryDirectory() as d:
        config = DPOConfig(output_dir=d, per_device_train_batch_size=args.batch, num_train_epochs=1, learning_rate=1e-5,
                           lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused",
                           save_strategy="no", report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True,
                           dataloader_num_workers=0, beta=0.1, loss_type="sigmoid", max_length=2 * args.max_len,
                           bf16=False, gradient_checkpointing=False)  # TRL 1.x's default is on: slower
        model = hf_pretrained(args)
        reference = copy.deepcopy(model).eval().requires_grad_(False)  # TRL reloads an instance's by its hub id
        trainer = DPOTrainer(model=model, ref_model=reference, args=config, train_dataset=data,
                             processing_class=tokenizer, callbacks=[HFClock(stamps)])
        trainer.data_collator = collator = Counting(trainer.data_collator)
        trainer.train()
    return ragged_rates(stamps, collator.batch_tokens)


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


def matmul_peak(threads: int) -> float:
    """This machine's float32 matrix-product rate (FLOP/s, best of a few 1024 x 1024 x 1024
    products at the benchmark's thread count, through BLAS and through oneDNN): the denominator of
    MFU."""
    from astrai.model.matmul import set_cpu_matmul

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = 0.0
    for library in ("blas", "auto"):  # auto: oneDNN where this build has it
        set_cpu_matmul(library)
        for _ in range(12):
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * 1024**3 / (time.perf_counter() - start))
    return best


def peer(run: Callable[[], tuple[float, float]], onednn: bool = False) -> Callable[[], tuple[float, float]]:
    """A peer's run on PyTorch's default matrix products, or on astrai's oneDNN routing."""
    def go() -> tuple[float, float]:
        from astrai.model.matmul import set_cpu_matmul

        set_cpu_matmul("auto" if onednn else "blas")  # auto: oneDNN where the build has it
        return run()
    return go


# -- driver ---------------------------------------------------------------------------------------


def measure(systems: dict, repeats: int, rows: list[str] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Median (wall, CPU) rates per system; systems run interleaved, so drift in machine load hits
    every system alike. With `rows`, only the first system (astrai's default) and those whose name
    contains one of them."""
    if rows:
        systems = {name: fn for i, (name, fn) in enumerate(systems.items()) if i == 0 or any(r in name for r in rows)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            results[name].append(fn())
    wall = {name: statistics.median(r[0] for r in v) for name, v in results.items()}
    cpu = {name: statistics.median(r[1] for r in v) for name, v in results.items()}
    return wall, cpu


def print_table(title: str, ours: str, wall: dict[str, float], cpu: dict[str, float],
                mfu: Callable[[float], float] | None = None) -> None:
    print(f"\n{title}\n")
    extra = " MFU (wall) |" if mfu else ""
    print(f"| system | tokens/CPU-s | {ours} / system | tokens/s (wall) | {ours} / system |{extra}")
    print("|---|---:|---:|---:|---:|" + ("---:|" if mfu else ""))
    for name in wall:
        tail = f" {mfu(wall[name]):.1%} |" if mfu else ""
        print(f"| {name} | {cpu[name]:,.0f} | {cpu[ours] / cpu[name]:.2f}x | {wall[name]:,.0f} | "
              f"{wall[ours] / wall[name]:.2f}x |{tail}")


def print_targets(ours: str, wall: dict[str, float], targets: dict[str, float]) -> None:
    """The issue's table: astrai's default against each peer at its best setting (the fastest of
    the peer's own rows, by wall-clock tokens per second), with the target ratio and whether it
    holds; then against the peer's row on astrai's oneDNN products, for reference."""
    print(f"\n| peer, at its best setting | tokens/s (wall) | {ours} / peer | target | met |")
    print("|---|---:|---:|---:|---|")
    for name, target in targets.items():
        own = [row for row in wall if row.startswith(name) and ONEDNN not in row]
        if not own:  # left out by --rows
            continue
        best = max(own, key=wall.get)
        ratio = wall[ours] / wall[best]
        print(f"| {best} | {wall[best]:,.0f} | {ratio:.2f}x | {target:.1f}x | {'yes' if ratio >= target else 'no'} |")
        for row in (row for row in wall if row.startswith(name) and ONEDNN in row):
            print(f"| {row} | {wall[row]:,.0f} | {wall[ours] / wall[row]:.2f}x | (reference) | |")


def flops_params(args) -> int:
    """Parameters that cost a multiply-add per token: all but the input embedding (the lm head
    counts, tied or not)."""
    model = astrai_model(args)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    return n + (model.config.vocab_size * model.config.hidden_size if model.config.tie_word_embeddings else 0)


def chat_scenarios(args, shape: str, ours_layout: str) -> None:
    """SFT and DPO on chat-like lengths: astrai's default layout, its padded path, and the peers."""
    from transformers import AutoTokenizer

    peak = matmul_peak(args.threads)
    n_params = flops_params(args)
    with tempfile.TemporaryDirectory() as d:
        if args.model_dir:
            tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        else:
            tokenizer = word_tokenizer(args.vocab, Path(d))
        vocab = min(len(tokenizer), astrai_model(args).config.vocab_size)
        spread = f"chat lengths (prompt median 48, reply median 96 tokens, log-normal, cut at {args.max_len})"
        default = f"astrai Trainer, row_layout {ours_layout} (default)"
        if "sft" in args.scenario:
            chats = make_chats(args, vocab)
            systems = {default: lambda: run_astrai_chat(args, chats, ours_layout)}
            for layout in ("flat", "pack", "pad"):
                if layout != ours_layout:
                    systems[f"astrai Trainer, row_layout {layout}"] = lambda layout=layout: run_astrai_chat(args, chats, layout)
            systems.update({
                "astrai Trainer, row_layout pad, group_by_length": lambda: run_astrai_chat(args, chats, "pad", True),
                "transformers Trainer, padded": peer(lambda: run_hf_trainer_chat(args, chats, False)),
                "transformers Trainer, group_by_length": peer(lambda: run_hf_trainer_chat(args, chats, True)),
                f"transformers Trainer, group_by_length, {ONEDNN}": peer(lambda: run_hf_trainer_chat(args, chats, True),
                                                                          onednn=True),
                "TRL SFTTrainer, padded": peer(lambda: run_trl_sft(args, chats, tokenizer, False)),
                "TRL SFTTrainer, padding_free": peer(lambda: run_trl_sft(args, chats, tokenizer, True)),
                f"TRL SFTTrainer, padded, {ONEDNN}": peer(lambda: run_trl_sft(args, chats, tokenizer, False), onednn=True),
            })
            wall, cpu = measure(systems, args.repeats, args.rows)
            print_table(f"SFT on {spread}: {shape}; one epoch of {args.examples} chats, {args.batch} per batch, loss on "
                        f"the reply; non-padding tokens, median of {args.repeats}; MFU: 6 x {n_params:,} FLOPs per token "
                        f"against {peak / 1e9:,.0f} GFLOP/s float32 matmul", default, wall, cpu,
                        lambda rate: 6 * n_params * rate / peak)
            print_targets(default, wall, {"transformers Trainer": 1.5, "TRL SFTTrainer": 2.0})
        if "dpo" in args.scenario:
            pairs = make_pairs(args, tokenizer)
            records = pair_records(pairs, tokenizer)
            default = f"astrai dpo, row_layout {ours_layout} (default)"
            systems = {default: lambda: run_astrai_chat(args, records, ours_layout, train_type="dpo")}
            for layout in ("flat", "pack", "pad"):
                if layout != ours_layout:
                    systems[f"astrai dpo, row_layout {layout}"] = (
                        lambda layout=layout: run_astrai_chat(args, records, layout, train_type="dpo"))
            systems["TRL DPOTrainer"] = peer(lambda: run_trl_dpo(args, pairs, tokenizer))
            systems[f"TRL DPOTrainer, {ONEDNN}"] = peer(lambda: run_trl_dpo(args, pairs, tokenizer), onednn=True)
            wall, cpu = measure(systems, args.repeats, args.rows)
            print_table(f"DPO on {spread}, chosen and rejected replies of independent lengths: {shape}; one epoch of "
                        f"{args.pairs} pairs, {args.batch} per batch, beta 0.1, a frozen reference; non-padding tokens "
                        f"of both replies, median of {args.repeats}; MFU: 8 x {n_params:,} FLOPs per token (policy "
                        f"forward and backward, reference forward)", default, wall, cpu,
                        lambda rate: 8 * n_params * rate / peak)
            print_targets(default, wall, {"TRL DPOTrainer": 1.5})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run (fewer steps, examples and repeats)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="fixed-length scenario: optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="examples (or pairs) per batch")
    p.add_argument("--seq_len", type=int, default=128, help="fixed-length scenario: tokens per row")
    p.add_argument("--examples", type=int, default=256, help="sft scenario: chats (one epoch)")
    p.add_argument("--pairs", type=int, default=96, help="dpo scenario: preference pairs (one epoch)")
    p.add_argument("--max_len", type=int, default=256, help="sft and dpo scenarios: longest chat in tokens")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--model", nargs="+", default=["tiny"],
                   help="'tiny' (the shape above, fresh) and/or model directories (e.g. .cache/smollm2); one table each")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true", help="fixed scenario: torch.compile the model in all three systems")
    p.add_argument("--scenario", nargs="+", choices=["fixed", "sft", "dpo"], default=["fixed", "sft", "dpo"])
    p.add_argument("--rows", nargs="+", default=None,
                   help="only the systems whose name contains one of these strings (and astrai's default)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.examples, args.pairs = 2, 8, 32, 24
    torch.set_num_threads(args.threads)
    from astrai.config import ObjectiveConfig

    ours_layout = ObjectiveConfig().row_layout
    for model in args.model:
        args.model_dir = None if model == "tiny" else model
        shape = (f"model hidden={args.hidden} layers={args.layers} vocab={args.vocab}" if args.model_dir is None
                 else f"model {Path(model).name}") + f", CPU ({args.threads} thread(s))"
        if "fixed" in args.scenario and args.model_dir is None:
            rows = make_rows(args.batch * args.steps, args.seq_len, args.vocab)
            wall, cpu = measure({
                "astrai Trainer": lambda rows=rows: run_astrai(args, rows),
                "transformers Trainer": peer(lambda rows=rows: run_hf_trainer(args, rows)),
                "plain PyTorch loop (transformers model)": peer(lambda rows=rows: run_plain_loop(args, rows)),
            }, args.repeats)
            print_table(f"SFT training throughput, rows of one length: {shape}, batch {args.batch} x {args.seq_len} "
                        f"tokens, {args.steps} steps, median of {args.repeats}{', torch.compile' if args.compile else ''}",
                        "astrai Trainer", wall, cpu)
        chat_scenarios(args, shape, ours_layout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
