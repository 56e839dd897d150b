"""LoRA vs full fine-tuning, and a DPO step with the adapter-disabled reference vs a copied one.

Same Llama-shaped model, same random token batches, same number of AdamW steps; every case runs
in its own process so peak RSS is its own. Columns: trainable parameters, optimizer-state bytes
(AdamW's two moments), the bytes of weights + a copied reference + gradients + optimizer state
(what the run holds besides activations), peak RSS, tokens/s (median of the timed steps). DPO cases build the
objective as a run does: a full run keeps a frozen deepcopy of the policy as reference, a LoRA
run calls the same module with its adapters disabled.

    .venv/bin/python benchmarks/bench_lora.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODEL = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
QUICK = dict(MODEL, hidden_size=256, intermediate_size=768, num_hidden_layers=4)
CASES = ("sft_full", "sft_lora", "dpo_full", "dpo_lora")


def run_case(case: str, quick: bool, steps: int, batch: int, seq: int) -> dict:
    import torch

    from astrai.config import load_config
    from astrai.model.config import ModelConfig
    from astrai.model.lora import apply_lora, count_parameters
    from astrai.model.transformer import CausalLM
    from astrai.train.objectives import DPOObjective, SFTObjective
    from astrai.train.optim import build_optimizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = CausalLM(ModelConfig(**(QUICK if quick else MODEL)), seed=0)
    if case.endswith("lora"):
        apply_lora(model, r=16, alpha=32)
    kind = case.split("_")[0]
    cfg = load_config(None, ["--train_type", kind, "--optimizer", "adamw"])
    objective = (DPOObjective if kind == "dpo" else SFTObjective)(cfg, model)
    optimizer = build_optimizer(model, cfg.optim)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (batch, seq))
    if kind == "dpo":
        other = torch.randint(0, V, (batch, seq))
        pos = torch.arange(seq).expand(batch, seq)
        ones = torch.ones(batch, seq, dtype=torch.long)
        data = {"chosen_input_ids": ids, "chosen_labels": ids, "chosen_attention_mask": ones,
                "chosen_position_ids": pos, "rejected_input_ids": other, "rejected_labels": other,
                "rejected_attention_mask": ones, "rejected_position_ids": pos}
        tokens = 2 * batch * seq
    else:
        data = {"input_ids": ids, "labels": ids}
        tokens = batch * seq
    times = []
    for step in range(steps + 1):  # the first step (allocations, lazy optimizer state) is not timed
        t0 = time.perf_counter()
        objective(model, data).loss.backward()
        optimizer.step()
        if step < steps:  # the last step's grads stay for the held-memory count
            optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - t0)
    # tensors the run holds besides activations: weights (+ a copied reference), grads, AdamW moments
    held, seen = 0, set()
    modules = [model] + [v for v in vars(objective).values() if isinstance(v, torch.nn.Module)]
    for t in [p for m in modules for p in m.parameters()] + [p.grad for p in model.parameters()]:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            held += t.untyped_storage().nbytes()
    trainable, total = count_parameters(model)
    optim_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                      for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"case": case, "trainable": trainable, "total": total, "optim_bytes": optim_bytes,
            "held_bytes": held + optim_bytes,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tokens_per_s": tokens / statistics.median(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child process
    args = p.parse_args()
    steps = args.steps or (3 if args.quick else 5)
    batch, seq = (2, 64) if args.quick else (4, 256)
    if args.case:
        print(json.dumps(run_case(args.case, args.quick, steps, batch, seq)))
        return 0
    rows = {}
    for case in CASES:
        cmd = [sys.executable, __file__, "--case", case, "--steps", str(steps)] + ["--quick"] * args.quick
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[case] = json.loads(out.strip().splitlines()[-1])
    print(f"## LoRA (r=16, all seven projections) vs full fine-tuning: {steps} AdamW steps, batch {batch} x {seq}\n")
    print("| case | trainable params | share | optimizer state MB | weights+ref+grads+optimizer MB | "
          "peak RSS MB | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows.values():
        print(f"| {r['case']} | {r['trainable']:,} | {100 * r['trainable'] / r['total']:.2f}% | "
              f"{r['optim_bytes'] / 2**20:.1f} | {r['held_bytes'] / 2**20:.1f} | {r['peak_rss_mb']:.0f} | {r['tokens_per_s']:.0f} |")
    for kind in ("sft", "dpo"):
        full, lora = rows[f"{kind}_full"], rows[f"{kind}_lora"]
        print(f"\n{kind}: LoRA / full peak RSS {lora['peak_rss_mb'] / full['peak_rss_mb']:.2f}, "
              f"optimizer state {lora['optim_bytes'] / max(full['optim_bytes'], 1):.3f}, held tensors "
              f"{(full['held_bytes'] - lora['held_bytes']) / 2**20:.1f} MB less, "
              f"tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
