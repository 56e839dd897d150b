"""Training-step throughput of astrai's model against the same model in transformers.

Builds one random transformers model (default: a small Llama, fp32), loads the very same
weights into astrai through `load_model`, checks that both give the same loss, then times
forward + backward on the same batch (default 8 x 256), alternating the two frameworks on every
repeat so that machine noise hits both alike. Prints a markdown table with tokens/s (median
over repeats) and astrai's ratio to transformers (target: >= 1.0x).

    .venv/bin/python benchmarks/bench_model.py [--quick] [--model_type qwen3_moe]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from astrai.model.hf import load_model  # noqa: E402

SIZES = {
    "full": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512),
    "quick": dict(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}
MOE = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


def build_pair(model_type: str, size: dict, tmp: str):
    """(transformers model, astrai model) with identical weights, both fp32 in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(size)
    if model_type.endswith("_moe"):
        kwargs.update(MOE, moe_intermediate_size=size["intermediate_size"] // 2)
        if model_type == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = size["intermediate_size"]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **kwargs)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers zero-initialises routers; random ones route for real
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.02)
    hf.save_pretrained(tmp)
    return hf.train(), load_model(tmp).train()


def step(model, ids: torch.Tensor, is_hf: bool) -> float:
    """One forward + backward of the next-token loss; returns the loss."""
    logits = model(input_ids=ids).logits if is_hf else model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def timed(model, ids: torch.Tensor, is_hf: bool) -> float:
    start = time.perf_counter()
    step(model, ids, is_hf)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, batch 2 x 128, 3 repeats")
    parser.add_argument("--model_type", default="llama",
                        choices=["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--seq_len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    batch = args.batch_size or (2 if args.quick else 8)
    seq_len = args.seq_len or (128 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 7)

    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build_pair(args.model_type, size, tmp)
    ids = torch.randint(0, size["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(0))
    loss_hf, loss_ours = step(hf, ids, True), step(ours, ids, False)  # also the warm-up
    if abs(loss_hf - loss_ours) > 1e-4:
        print(f"warning: losses differ (transformers {loss_hf:.6f}, astrai {loss_ours:.6f})", file=sys.stderr)
    times: dict[str, list[float]] = {"transformers": [], "astrai": []}
    for i in range(repeats):
        # alternate which goes first, so neither always runs on a warmer cache
        order = [("transformers", hf, True), ("astrai", ours, False)]
        for name, model, is_hf in order if i % 2 == 0 else order[::-1]:
            times[name].append(timed(model, ids, is_hf))

    tokens = batch * seq_len
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    print(f"\n### Model forward+backward, {args.model_type} {params:.1f}M params, fp32, "
          f"batch {batch} x {seq_len}, median of {repeats}, torch threads {torch.get_num_threads()}\n")
    print("| framework | tokens/s | median step (s) | ratio vs transformers |")
    print("|---|---:|---:|---:|")
    for name in ("astrai", "transformers"):
        print(f"| {name} | {rate[name]:,.0f} | {statistics.median(times[name]):.3f} | "
              f"{rate[name] / rate['transformers']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
