"""Preprocessing throughput: `astrai preprocess` against plain tokenizers / transformers.

Text records (seq): astrai's full path (JSONL read, validation, batch encode, eos, shard write
with offsets) against the peer `tokenizers.Tokenizer.encode_batch` over the same texts written
to one numpy uint16 file. Chat records (sft): astrai (template rendering, incremental loss mask,
shard write) against transformers' `apply_chat_template(tokenize=True)` per record (ids only,
no mask). Repeats are interleaved and the median is reported. Target: >= 1M tokens/min for text.

    .venv/bin/python benchmarks/bench_preprocess.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402

from astrai.data.preprocess import preprocess  # noqa: E402
from astrai.data.tasks import generate_items  # noqa: E402
from astrai.data.tokenizer import load_tokenizer  # noqa: E402
from astrai.data.tokenizer_training import train_tokenizer  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her they which one all were "
         "model data token train loss batch layer attention cache value reward policy gradient step "
         "learning rate memory shard record chat assistant user system answer question number").split()


def make_texts(n: int, rng: random.Random) -> list[str]:
    texts = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(60, 160))]
        texts.append(" ".join(words).capitalize() + f". {rng.randint(0, 99999)} items.")
    return texts


def make_chats(n: int, rng: random.Random) -> list[dict]:
    items = generate_items(n, ["add", "mul", "reverse"], digits=3, seed=rng.randint(0, 10**6))
    chats = []
    for item in items:
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
        chats.append({"messages": [{"role": "system", "content": "Answer with the result only."},
                                   {"role": "user", "content": f"{context}. {item.question}"},
                                   {"role": "assistant", "content": item.answer}]})
    return chats


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def astrai_run(src: Path, tok_dir: Path, work: Path, train_type: str) -> int:
    out = work / f"astrai_{train_type}"
    shutil.rmtree(out, ignore_errors=True)
    info = preprocess([src], out, tok_dir, train_type, max_seq_len=512)
    return info["num_tokens"]


def peer_text_run(texts: list[str], tok, work: Path) -> int:
    eos = tok.eos_token_id
    ids = [e.ids + [eos] for e in tok.backend.encode_batch(texts)]
    flat = np.fromiter((t for doc in ids for t in doc), dtype=np.uint16)
    flat.tofile(work / "peer_text.bin")
    return len(flat)


def peer_chat_run(chats: list[dict], hf_tok, work: Path) -> int:
    ids = [hf_tok.apply_chat_template(c["messages"], tokenize=True)["input_ids"] for c in chats]
    flat = np.fromiter((t for doc in ids for t in doc), dtype=np.uint16)
    flat.tofile(work / "peer_chat.bin")
    return len(flat)


def compare(name: str, ours, peer, repeats: int) -> dict:
    ours_t, peer_t = [], []
    for _ in range(repeats):  # interleaved so machine load hits both alike
        seconds, ours_tokens = timed(ours)
        ours_t.append(ours_tokens / seconds)
        seconds, peer_tokens = timed(peer)
        peer_t.append(peer_tokens / seconds)
    return {"name": name, "ours": statistics.median(ours_t), "peer": statistics.median(peer_t),
            "tokens": ours_tokens, "peer_tokens": peer_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    n_text, n_chat = (1000, 500) if args.quick else (10000, 4000)
    repeats = args.repeats or (2 if args.quick else 5)
    rng = random.Random(0)
    texts, chats = make_texts(n_text, rng), make_chats(n_chat, rng)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok_dir = work / "tok"
        train_tokenizer(texts[:500] + [json.dumps(c) for c in chats[:200]], 2048, tok_dir)
        tok, hf_tok = load_tokenizer(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
        text_src, chat_src = work / "text.jsonl", work / "chat.jsonl"
        text_src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        chat_src.write_text("".join(json.dumps(c) + "\n" for c in chats))
        rows = [
            compare("text records (seq)", lambda: astrai_run(text_src, tok_dir, work, "seq"),
                    lambda: peer_text_run(texts, tok, work), repeats),
            compare("chat records (sft, with loss mask)", lambda: astrai_run(chat_src, tok_dir, work, "sft"),
                    lambda: peer_chat_run(chats, hf_tok, work), repeats),
        ]
    print(f"## preprocess throughput ({'quick, ' if args.quick else ''}{repeats} interleaved repeats, median)\n")
    print("| records | tokens | astrai tokens/s | astrai tokens/min | peer | peer tokens/s | astrai / peer |")
    print("|---|---:|---:|---:|---|---:|---:|")
    peers = ["tokenizers encode_batch -> numpy", "transformers apply_chat_template"]
    for row, peer in zip(rows, peers):
        print(f"| {row['name']} | {row['tokens']:,} | {row['ours']:,.0f} | {row['ours'] * 60 / 1e6:.2f}M | {peer} "
              f"| {row['peer']:,.0f} | {row['ours'] / row['peer']:.2f} |")
    target = rows[0]["ours"] * 60
    print(f"\ntext target >= 1M tokens/min: {'met' if target >= 1e6 else 'NOT met'} ({target / 1e6:.2f}M/min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
