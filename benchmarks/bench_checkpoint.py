"""Checkpoint save/load cost of astrai's atomic publish against plain `torch.save` and transformers.

One random ~50M-parameter Llama-shaped model; the same weights go to every writer, in one
process, with the writers alternated on every repeat (median over repeats):
1. weights only: astrai `publish` of a model directory (save_model into a hidden staging dir,
   fsync and sha256 of every file, manifest, rename, fsync of the parent) vs `torch.save` of the
   state dict vs transformers `save_pretrained`; and loading each back (astrai `load_model`,
   `torch.load`, `from_pretrained`).
2. full training state (model + AdamW moments + scheduler + trainer state):
   `save_training_checkpoint` vs one `torch.save` of the same dicts.
Publish is durable (fsync) and checksummed; the peers are neither, so the table also splits
publish into its writing, hashing and fsync parts, and shows the caller's blocking time with
`background=True` (hash, fsync and rename on a thread). Ratios are astrai / peer (lower is better).

    .venv/bin/python benchmarks/bench_checkpoint.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from astrai.model.config import ModelConfig  # noqa: E402
from astrai.model.hf import load_model, save_model  # noqa: E402
from astrai.model.transformer import CausalLM  # noqa: E402
from astrai.train import checkpoint as ckpt  # noqa: E402
from astrai.train import publish as pub  # noqa: E402

MODEL_50M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def fsync_tree(path: Path) -> None:
    """What durability costs a peer: fsync every file it wrote (publish does this too)."""
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def interleaved(fns: dict[str, Callable[[int], object]], repeats: int) -> dict[str, float]:
    """Median seconds per function; every repeat runs all of them once, in rotating order."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name](r)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def publish_parts(model: CausalLM, root: Path, repeats: int) -> dict[str, float]:
    """Publish's cost split into writing, hashing + fsync of files (sealing), and the rest."""
    write, seal = [], []
    for r in range(repeats):
        staging = root / f"parts{r}"
        start = time.perf_counter()
        save_model(model, staging)
        mid = time.perf_counter()
        pub._seal(staging, r)
        end = time.perf_counter()
        write.append(mid - start)
        seal.append(end - mid)
        shutil.rmtree(staging)
    blocking = []
    for r in range(repeats):
        start = time.perf_counter()
        pub.publish(root / "background", r, lambda d: save_model(model, d), keep_last=1, background=True)
        blocking.append(time.perf_counter() - start)
        pub.wait_for_publish()  # untimed: the training loop would be running meanwhile
    return {"write (save_model)": statistics.median(write), "hash + fsync + manifest": statistics.median(seal),
            "blocking, background=True": statistics.median(blocking)}


def bench_weights(model: CausalLM, hf_model, root: Path, repeats: int) -> list[tuple[str, float, float, int]]:
    state = model.state_dict()
    out = {name: root / name for name in ("publish", "torch_save", "save_pretrained", "durable")}
    for p in out.values():
        p.mkdir()

    def clean(path: Path) -> None:
        for child in path.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()

    save = interleaved({
        "publish": lambda r: pub.publish(out["publish"], r, lambda d: save_model(model, d), keep_last=1),
        "torch_save": lambda r: (clean(out["torch_save"]), torch.save(state, out["torch_save"] / "model.pt")),
        "durable": lambda r: (clean(out["durable"]), hf_model.save_pretrained(out["durable"]),
                              fsync_tree(out["durable"])),
        "save_pretrained": lambda r: (clean(out["save_pretrained"]), hf_model.save_pretrained(out["save_pretrained"])),
    }, repeats)
    from transformers import AutoModelForCausalLM

    published = pub.latest_checkpoint(out["publish"])
    load = interleaved({
        "publish": lambda r: load_model(published),
        "torch_save": lambda r: torch.load(out["torch_save"] / "model.pt", weights_only=True),
        "durable": lambda r: AutoModelForCausalLM.from_pretrained(out["durable"]),
        "save_pretrained": lambda r: AutoModelForCausalLM.from_pretrained(out["save_pretrained"]),
    }, repeats)
    sizes = {"publish": dir_bytes(published), "torch_save": dir_bytes(out["torch_save"]),
             "save_pretrained": dir_bytes(out["save_pretrained"]), "durable": dir_bytes(out["durable"])}
    return [(name, save[name], load[name], sizes[name]) for name in save]


def bench_training_state(model: CausalLM, root: Path, repeats: int) -> dict[str, tuple[float, int]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialise the AdamW moments (2 x the weights)
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    plain = root / "plain"
    plain.mkdir()

    def save_plain(r: int) -> None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "trainer_state": {"step": r}}, plain / "ckpt.pt")

    def save_astrai(r: int) -> None:
        ckpt.save_training_checkpoint(root / "full", r, model=model, tokenizer=None, optimizer=opt,
                                      scheduler=sched, trainer_state={"step": r}, keep_last=1)

    times = interleaved({"save_training_checkpoint": save_astrai, "torch.save (one file)": save_plain}, repeats)
    latest = pub.latest_checkpoint(root / "full")
    return {"save_training_checkpoint": (times["save_training_checkpoint"], dir_bytes(latest)),
            "torch.save (one file)": (times["torch.save (one file)"], dir_bytes(plain))}


def hf_twin(model: CausalLM):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODEL_50M, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg)
    hf.load_state_dict(model.state_dict(), strict=False)  # same tensors (rotary buffers aside)
    return hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for a smoke run)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**MODEL_50M), seed=0)
    hf_model = hf_twin(model)
    n_params = sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        rows = bench_weights(model, hf_model, root, repeats)
        parts = publish_parts(model, root, repeats)
        full = bench_training_state(model, root, max(2, repeats // 2))

    ref_save, ref_load = rows[-1][1], rows[-1][2]
    print(f"\n### Checkpoint cost, {n_params / 1e6:.1f}M parameters (fp32), median of {repeats} interleaved repeats\n")
    print("| writer | save s | save vs save_pretrained | load s | load vs from_pretrained | MB on disk |")
    print("|---|---:|---:|---:|---:|---:|")
    labels = {"publish": "astrai publish (atomic, fsync, sha256)", "torch_save": "torch.save state_dict",
              "save_pretrained": "transformers save_pretrained",
              "durable": "save_pretrained + fsync of its files"}
    for name, save_s, load_s, size in rows:
        print(f"| {labels[name]} | {save_s:.3f} | {save_s / ref_save:.2f}x | {load_s:.3f} | "
              f"{load_s / ref_load:.2f}x | {size / 1e6:.1f} |")
    print("\n| publish, split | seconds | vs save_pretrained |")
    print("|---|---:|---:|")
    for name, s in parts.items():
        print(f"| {name} | {s:.3f} | {s / ref_save:.2f}x |")
    print("\n| full training state (model + AdamW + scheduler) | save s | ratio | MB on disk |")
    print("|---|---:|---:|---:|")
    ref = full["torch.save (one file)"][0]
    for name, (s, size) in full.items():
        print(f"| {name} | {s:.3f} | {s / ref:.2f}x | {size / 1e6:.1f} |")


if __name__ == "__main__":
    main()
