"""The GPU lane in one run: every CUDA path astrai has, measured side by side with its peer on the
same device, in one table (and `--out FILE.json`).

Rows: bf16 SFT tokens/s and MFU (SmolLM2-135M from `.cache/smollm2` when present, `make
real-model` makes it, and a ~1B random-init Llama) against transformers' Trainer; offline
generation tokens/s against transformers' static batches and its `generate_batch` continuous
batching, plus astrai's own CUDA-only switches (`cuda_graphs`, `paged_kernel="varlen"`) against
its default; serving at concurrency 32 against `transformers serve` (bench_serve.py's servers
and load); an online GRPO step against TRL's GRPOTrainer (bench_rl.py's task and TRL setup); NCCL
DDP at world size 1 (and 2 when two GPUs exist); the suite's `cuda`-marked tests.

Each row runs in its own process under a time limit (`--row_timeout`), so a crash or a hang in
one path is that row's failure: its traceback is printed under the row and the run goes on. A
missing peer is a skipped row with the reason. Timings synchronise the device before reading
the clock. `--device cpu --quick` runs every row with tiny models on a CPU (the suite runs it),
so the script's first GPU run does not die on a typo. In every row the ratio is astrai's speed over
the peer's (above 1: astrai is faster); MFU counts 6 x parameters FLOPs per trained token against
the GPU's dense bf16 peak.

    .venv/bin/python benchmarks/gpu_check.py --out gpu_check.json            # on a GPU (< 8 min on an H200)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick --out q.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
# child processes (servers, pytest, torchrun) import astrai from this tree, installed or not
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


class Skip(Exception):
    """A row that cannot run here (a missing peer, model or second GPU): skipped, with the reason."""


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def result(astrai: float | None, peer: float | None, unit: str, peer_name: str = "", **extra) -> dict:
    ratio = astrai / peer if astrai and peer else None
    return {"astrai": astrai, "peer": peer, "peer_name": peer_name, "unit": unit, "ratio": ratio, **extra}


# -- SFT: astrai's Trainer vs transformers' Trainer, bf16 -----------------------------------------
def _sft_rows(vocab: int, num_rows: int, seq_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (num_rows, seq_len + 1), generator=g).tolist()


def _astrai_sft(model: torch.nn.Module, rows: list[list[int]], args) -> float:
    from bench_train import AstraiSFTRows

    from astrai.config import load_config
    from astrai.train.callbacks import CheckpointSaver
    from astrai.train.trainer import Trainer

    stamps: list[float] = []

    class Clock:
        def after_optimizer_step(self, trainer):
            sync(args.device)
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, ["--train_type", "sft", "--batch_per_device", str(args.batch), "--max_steps",
                                 str(args.train_steps), "--max_lr", "1e-4", "--schedule", "constant", "--log_dir", d,
                                 "--ckpt_dir", d, "--ckpt_interval", "0", "--progress", "false",
                                 "--device", args.device, "--bf16", str(args.bf16).lower()])
        trainer = Trainer(cfg, model=model, train_dataset=AstraiSFTRows(rows), callbacks=[Clock()])
        trainer.callbacks.callbacks = [c for c in trainer.callbacks.callbacks if not isinstance(c, CheckpointSaver)]
        trainer.train()
    return (len(stamps) - 1) * args.batch * args.seq_len / (stamps[-1] - stamps[0])


def _hf_sft(hf_model: torch.nn.Module, rows: list[list[int]], args) -> float:
    from bench_train import hf_collate
    from transformers import Trainer, TrainerCallback, TrainingArguments

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            sync(args.device)
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(
            output_dir=d, per_device_train_batch_size=args.batch, max_steps=args.train_steps, learning_rate=1e-4,
            lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused", save_strategy="no",
            report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=not args.device.startswith("cuda"),
            dataloader_num_workers=0, remove_unused_columns=False, bf16=args.bf16)
        Trainer(model=hf_model, args=targs, train_dataset=[{"input_ids": r[:-1]} for r in rows],
                data_collator=hf_collate, callbacks=[Clock()]).train()
    return (len(stamps) - 1) * args.batch * args.seq_len / (stamps[-1] - stamps[0])


def _sft_compare(model_dir: Path | None, shape: dict | None, args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from astrai.model import CausalLM, ModelConfig
    from astrai.model.hf import load_model

    if model_dir is not None:
        model = load_model(model_dir)
        hf_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = CausalLM(ModelConfig(**shape), seed=0)
        torch.manual_seed(0)
        hf_model = LlamaForCausalLM(LlamaConfig(**shape, rms_norm_eps=1e-6))
    vocab = model.config.vocab_size
    num_params = sum(p.numel() for p in model.parameters())
    rows = _sft_rows(vocab, args.batch * (args.train_steps + 1), args.seq_len)
    ours = _astrai_sft(model.to(args.device), rows, args)
    del model
    peer = _hf_sft(hf_model, rows, args)
    peak = peak_tflops(args.device)
    mfu = (lambda tok_s: 6 * num_params * tok_s / (peak * 1e12)) if peak else (lambda tok_s: None)
    return result(ours, peer, "tok/s", "transformers Trainer", params=num_params, mfu=mfu(ours), peer_mfu=mfu(peer))


def row_sft_smollm2(args) -> dict:
    path = ROOT / ".cache" / "smollm2"
    if args.quick:
        return _sft_compare(None, TINY, args)
    if not (path / "config.json").exists():
        raise Skip("no .cache/smollm2 (run `make real-model` first)")
    return _sft_compare(path, None, args)


def row_sft_1b(args) -> dict:
    return _sft_compare(None, TINY if args.quick else LLAMA_1B, args)


# -- offline generation -------------------------------------------------------------------------
def _gen_models(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from astrai.model.hf import load_model

    shape = TINY if args.quick else {**LLAMA_1B, "num_hidden_layers": 8}
    d = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    hf = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    hf.save_pretrained(d)
    return hf.to(args.device, dtype), load_model(d, dtype="bfloat16" if args.bf16 else None, device=args.device).eval()


def _gen_prompts(args) -> list[list[int]]:
    from bench_generate import make_prompts

    return make_prompts(args.num_prompts, 8, 64 if args.quick else 256, TINY["vocab_size"], seed=0)


def _timed(fn: Callable[[], object], args) -> float:
    device = args.device
    # warm-ups: allocations, kernel choices, lazy graph capture. In a fresh CUDA process the first
    # two runs both pay one-off costs (an H200, 2026-12-04: 938, 2,628, then 10,477 tok/s). The
    # quick CPU mode is a smoke run: it times the first call (transformers' generate_batch costs
    # about 10 s a call on a CPU, whatever the size)
    for _ in range(0 if args.quick else 2 if device.startswith("cuda") else 1):
        fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _astrai_generate(model, prompts, args, **engine) -> float:
    from astrai.infer.llm import LLM
    from astrai.infer.sampling import SamplingParams

    llm = LLM(model, None, kv_cache_tokens=max(4096, len(prompts) * (300 + args.new_tokens)),
              max_num_seqs=len(prompts), **engine)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    return _timed(lambda: llm.generate(prompts, params), args)


def row_generate(args) -> dict:
    from bench_generate import hf_static

    hf, model = _gen_models(args)
    prompts = _gen_prompts(args)
    tokens = len(prompts) * args.new_tokens
    ours = tokens / _astrai_generate(model, prompts, args)
    ids = [[t + 0 for t in p] for p in prompts]
    peer = tokens / _timed(lambda: hf_static(hf, ids, args.new_tokens, len(ids), 0), args)
    return result(ours, peer, "tok/s", "transformers generate (static batch)")


def row_generate_continuous(args) -> dict:
    from bench_generate import hf_continuous

    hf, model = _gen_models(args)
    prompts = _gen_prompts(args)
    run = hf_continuous(hf, prompts, args.new_tokens)
    if run is None:
        raise Skip("transformers generate_batch is unavailable or fails here")
    tokens = len(prompts) * args.new_tokens
    return result(tokens / _astrai_generate(model, prompts, args), tokens / _timed(run, args), "tok/s",
                  "transformers generate_batch")


def _cuda_only(args) -> None:
    if not args.device.startswith("cuda"):
        raise Skip("a CUDA-only engine path (refused on cpu by design)")


def row_generate_cuda_graphs(args) -> dict:
    _cuda_only(args)
    _, model = _gen_models(args)
    prompts = _gen_prompts(args)
    tokens = len(prompts) * args.new_tokens
    return result(tokens / _astrai_generate(model, prompts, args, cuda_graphs=True),
                  tokens / _astrai_generate(model, prompts, args), "tok/s", "astrai eager decode")


def row_generate_varlen(args) -> dict:
    from astrai.model.kernels import paged_varlen_supported

    _cuda_only(args)
    if not paged_varlen_supported():
        raise Skip(f"torch {torch.__version__}'s varlen_attn takes no block table (paged_kernel='varlen' refuses it)")
    _, model = _gen_models(args)
    prompts = _gen_prompts(args)
    tokens = len(prompts) * args.new_tokens
    return result(tokens / _astrai_generate(model, prompts, args, paged_kernel="varlen"),
                  tokens / _astrai_generate(model, prompts, args), "tok/s", "astrai gather decode")


# -- serving at concurrency 32 ------------------------------------------------------------------
def row_serve_c32(args) -> dict:
    import asyncio

    from bench_serve import make_tiny_model, run_load, start_servers

    path = ROOT / ".cache" / "smollm2"
    model_dir = path if (path / "config.json").exists() and not args.quick else make_tiny_model(
        Path(tempfile.mkdtemp()) / "model")
    concurrency, num = (2, 2) if args.quick else (32, 128)
    max_tokens = 8 if args.quick else 128  # (4 tokens of the tiny random model can be no visible text)
    out = {}
    for with_peer in (False, True):
        try:
            servers = start_servers(model_dir, with_peer, 1024, max_seqs=concurrency)
        except Exception as exc:  # noqa: BLE001 - a peer that does not start is a reported skip
            if not with_peer:
                raise
            out["peer_error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            break
        try:
            server = servers[-1]
            out[server.name] = asyncio.run(run_load(server, concurrency, num, max_tokens))
        except RuntimeError as exc:  # the peer's requests failing is the peer's, reported in the row
            if not with_peer:
                raise
            out["peer_error"] = str(exc)[-300:]
        finally:
            for s in servers:
                s.stop()
    peer = out.get("transformers", {}).get("tok_s")
    return result(out["astrai"]["tok_s"], peer, "tok/s", "transformers serve", concurrency=concurrency,
                  detail={k: v for k, v in out.items() if k != "peer_error"}, note=out.get("peer_error", ""))


# -- online GRPO step ---------------------------------------------------------------------------
def row_grpo(args) -> dict:
    from bench_rl import setup

    from astrai.config import load_config
    from astrai.train.rl.loop import OnlineLoop

    tmp = Path(tempfile.mkdtemp())
    rl = argparse.Namespace(steps=2 if args.quick else 6, prompts=2 if args.quick else 8, group_size=4 if args.quick
                            else 8, max_tokens=8 if args.quick else 64, lr=1e-4, seed=0)
    prompts, model_dir = setup(tmp, rl.prompts * rl.steps, 0, None)  # None: a fresh tiny model
    stamps: list[float] = []
    rollout_s: list[float] = []
    detail: dict = {}

    class Clock:
        requested_metrics = frozenset()

        prof = None

        def after_optimizer_step(self, loop) -> None:
            sync(args.device)
            stamps.append(time.perf_counter())
            rollout_s.append(float(loop.step_metrics.get("rollout_seconds", 0.0)))
            if args.profile and len(stamps) == 2:  # one whole step after the first, under the profiler
                self.prof = torch.profiler.profile(record_shapes=False)
                self.prof.__enter__()
            elif self.prof is not None and len(stamps) == 3:
                self.prof.__exit__(None, None, None)
                detail["profile"] = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                                                   max_name_column_width=60)
                self.prof = None

    flags = {"train_type": "online_grpo", "data_path": prompts, "param_path": model_dir, "device": args.device,
             "batch_per_device": rl.prompts, "group_size": rl.group_size, "rollout_max_tokens": rl.max_tokens,
             "rollout_temperature": 1.0, "max_steps": rl.steps + 1, "n_epoch": 100, "max_lr": rl.lr,
             "schedule": "constant", "kl_coef": 0.0, "ckpt_dir": tmp / "ckpt", "ckpt_interval": 0,
             "log_dir": tmp, "progress": False, "bf16": args.bf16}
    cfg = load_config(None, [x for k, v in flags.items() for x in (f"--{k}", str(v).lower() if isinstance(v, bool)
                                                                   else str(v))])
    OnlineLoop(cfg, callbacks=[Clock()]).train()
    ours = (stamps[-1] - stamps[1]) / (len(stamps) - 2)  # the first step pays one-off costs: skipped
    # where astrai's step goes: its rollout (generation, rewards) against the rest (the first step skipped)
    detail["rollout_s_per_step"] = sum(rollout_s[2:]) / max(len(rollout_s) - 2, 1)
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return result(ours, None, "s/step", "TRL GRPOTrainer", note=f"peer skipped: {exc}", detail=detail)
    peer = _trl_grpo(prompts, model_dir, tmp / "trl", rl, args)
    # seconds per step: the ratio is peer / astrai, so above 1 means astrai is faster, as in every row
    return {**result(ours, peer["step_s"], "s/step", "TRL GRPOTrainer"), "ratio": peer["step_s"] / ours,
            "detail": detail, "peer_detail": peer}


def _trl_grpo(prompts: Path, model_dir: Path, out: Path, rl, args) -> dict:
    """bench_rl.py's TRL run (trl_common's settings), on this device and in this precision."""
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl_common import StepClock, exact_match, prompt_dataset, rollout_args, time_generation, train_args

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k) -> None:
            clock.start()

        def on_step_end(self, *a, **k) -> None:
            sync(args.device)
            clock.tick()

    # grpo_config's fields, with the device and precision of this run (train_args pins CPU fp32)
    base = train_args(out, steps=rl.steps + 1, lr=rl.lr, seed=rl.seed)
    config = GRPOConfig(**{**base, "use_cpu": not args.device.startswith("cuda"), "bf16": args.bf16},
                        **rollout_args(prompts=rl.prompts, group_size=rl.group_size, max_tokens=rl.max_tokens),
                        loss_type="dapo", scale_rewards="group")
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=prompt_dataset(prompts),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    time_generation(trainer, clock)
    trainer.train()
    return clock.summary()


# -- NCCL DDP -----------------------------------------------------------------------------------
def _ddp_worker(rank: int, world: int, port: int, device_type: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from astrai.model import CausalLM, ModelConfig
    from astrai.train.dist import cleanup

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    model = DistributedDataParallel(CausalLM(ModelConfig(**TINY), seed=0).to(device),
                                    device_ids=[rank] if device_type == "cuda" else None)
    ids = torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(rank)).to(device)
    model(ids).logits.float().square().mean().backward()
    grad = next(model.parameters()).grad.detach().clone()
    peers = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(peers, grad)
    same = all(torch.equal(p, peers[0]) for p in peers)  # DDP averaged the gradients on every rank
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "world_size": world, "grads_equal": same}))
    del model  # DDP's reducer holds the process group; gloo aborts if it is torn down under it
    cleanup()  # astrai's own leaving: a barrier, gloo's worker threads let finish, then the group destroyed


def _ddp(args, world: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    if args.device.startswith("cuda") and torch.cuda.device_count() < world:
        raise Skip(f"{world} GPUs needed, {torch.cuda.device_count()} present")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "ddp.json"
    start = time.perf_counter()
    mp.spawn(_ddp_worker, args=(world, port, args.device.split(":")[0], str(out)), nprocs=world)
    info = json.loads(out.read_text())
    if not info["grads_equal"]:
        raise AssertionError(f"DDP world size {world}: gradients differ across ranks")
    return result(None, None, "", "", seconds=time.perf_counter() - start, **info)


def row_ddp_1(args) -> dict:
    return _ddp(args, 1)


def row_ddp_2(args) -> dict:
    return _ddp(args, 2)  # skipped with one GPU; gloo on CPU (the script's 2-process path)


# -- the suite's cuda-marked tests --------------------------------------------------------------
def row_pytest_cuda(args) -> dict:
    # only the files that hold cuda-marked tests: collecting the whole suite would import peers
    # (openai, anthropic, lm-eval, ...) that a bare GPU image lacks
    paths = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                   if "mark.cuda" in f.read_text(encoding="utf-8"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *paths],
                          cwd=ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise AssertionError(f"pytest -m cuda failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return result(None, None, "", "", summary=tail)


ROWS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "sft_smollm2": row_sft_smollm2, "sft_1b": row_sft_1b, "generate": row_generate,
    "generate_continuous": row_generate_continuous, "generate_cuda_graphs": row_generate_cuda_graphs,
    "generate_varlen": row_generate_varlen, "serve_c32": row_serve_c32, "grpo": row_grpo,
    "ddp_1": row_ddp_1, "ddp_2": row_ddp_2, "pytest_cuda": row_pytest_cuda,
}


# -- running rows -------------------------------------------------------------------------------
def run_row(name: str, fn: Callable[[argparse.Namespace], dict], args) -> dict:
    """One row in this process: ok with its figures, skipped with the reason, or failed with the traceback."""
    start = time.perf_counter()
    try:
        row = {"status": "ok", **fn(args)}
    except Skip as exc:
        row = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a broken path is this row's failure, not the run's
        row = {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:300]}", "traceback": traceback.format_exc()}
    return {"name": name, **row, "seconds": round(time.perf_counter() - start, 2)}


def run_isolated(name: str, args, argv: list[str]) -> dict:
    """One row in a child process under the time limit (a crash or hang stays that row's); on a
    timeout its whole process group goes, servers it started included."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "row.json"
        cmd = [sys.executable, __file__, *argv, "--rows", name, "--in_process", "--out", str(out), "--quiet"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=args.row_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            return {"name": name, "status": "failed", "reason": f"timed out after {args.row_timeout:g} s",
                    "traceback": log[-3000:], "seconds": round(time.perf_counter() - start, 2)}
        if out.exists():
            row = json.loads(out.read_text())["rows"][0]
            if row["status"] == "failed" and log.strip():  # what its own children printed (a crash's message)
                row["traceback"] = f"{row.get('traceback', '')}\n-- the row process's output --\n{log[-3000:]}"
            return row
        return {"name": name, "status": "failed", "reason": f"row process exited {proc.returncode} without a result",
                "traceback": log[-4000:], "seconds": round(time.perf_counter() - start, 2)}


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def print_row(row: dict) -> None:
    mfu = f" mfu {row['mfu']:.1%} vs {row['peer_mfu']:.1%}" if row.get("mfu") and row.get("peer_mfu") else ""
    extra = row.get("reason") or row.get("summary") or row.get("note") or row.get("peer_name", "")
    print(f"{row['name']:<22} {row['status']:<8} {_fmt(row.get('astrai')):>10} {_fmt(row.get('peer')):>10} "
          f"{_fmt(row.get('ratio')):>7} {row.get('unit', ''):<7} {row['seconds']:>7.1f}s  {extra}{mfu}", flush=True)
    if row["status"] == "failed" and row.get("traceback"):
        print("    " + row["traceback"].rstrip().replace("\n", "\n    "), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny models and few steps (the CPU smoke run)")
    p.add_argument("--dry_run", action="store_true", help="same as --device cpu --quick")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of rows to run")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument("--row_timeout", type=float, default=None, help="seconds per row (default 150; 300 with --quick on a slow CPU)")
    p.add_argument("--budget", type=float, default=450, help="seconds for the whole run: rows that would start "
                   "later are skipped (default 450, to stay under 8 minutes)")
    p.add_argument("--profile", action="store_true", help="grpo row: profile one astrai step (the table goes "
                   "into the row's detail)")
    p.add_argument("--in_process", action="store_true", help="run rows in this process (no time limit)")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.quick = "cpu", True
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; expected some of {', '.join(ROWS)}")
    args.row_timeout = args.row_timeout or (300 if args.quick else 150)
    args.bf16 = args.device.startswith("cuda")
    args.batch, args.seq_len = (2, 32) if args.quick else (8, 1024)
    args.train_steps = 3 if args.quick else 12
    args.num_prompts, args.new_tokens = (4, 4) if args.quick else (64, 128)
    child_argv = [a for a in argv if a not in ("--in_process",)]
    child_argv = _without(child_argv, ("--rows", "--out", "--budget"))
    rows = []
    if not args.quiet:
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        print(f"gpu_check on {gpu} (torch {torch.__version__}), {'quick' if args.quick else 'full'}", flush=True)
        print(f"{'row':<22} {'status':<8} {'astrai':>10} {'peer':>10} {'ratio':>7} {'unit':<7} {'time':>8}  peer / note")
    started = time.perf_counter()
    for name in names:
        left = args.budget - (time.perf_counter() - started)
        args.row_timeout = min(args.row_timeout, max(left, 1.0))
        if left <= 0:
            row = {"name": name, "status": "skipped", "reason": f"over the run's {args.budget:g} s budget", "seconds": 0.0}
        elif args.in_process:
            row = run_row(name, ROWS[name], args)
        else:
            row = run_isolated(name, args, child_argv)
        rows.append(row)
        if not args.quiet:
            print_row(row)
    if args.out:
        meta = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                "torch": torch.__version__, "quick": args.quick, "date": time.strftime("%Y-%m-%d")}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
