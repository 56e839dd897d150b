"""Online RL step time and memory: astrai's OnlineLoop (GRPO, DPO, PPO) vs TRL's GRPOTrainer.

Both systems train the same model on the same arithmetic prompt records (`astrai.data.tasks`,
chat-templated by the model directory's own chat template with the generation prompt) with the
same settings: prompts per step, group size (completions per prompt), new tokens, temperature 1
without top-k / top-p, AdamW at a constant learning rate, gradient clipping at 1.0, beta (KL) 0,
PPO clip 0.2, token-mean loss (TRL's `dapo`), one optimizer step per generation, fp32, and an
`exact_match` reward (the completion equals the answer after strip). The model is either a
freshly initialised tiny Llama-shaped one (default; astrai writes it as an HF model directory)
or any HF model directory given by `--model DIR` (e.g. SmolLM2-135M-Instruct from
`make real-model`); TRL loads the same directory with transformers.

Same work: by default every completion is exactly the new-token budget long in both systems
(the end tokens are forbidden before it: astrai's `min_tokens`, TRL's `min_new_tokens`), since a
real model stops early at random and the two would otherwise generate and train on different
lengths; `--stop_at_eos` lets them stop, and the table's tokens-per-step column shows what each
did. (With every completion at full length, `exact_match` is 0 everywhere: GRPO advantages are 0
but both systems still run the whole loss and backward; online DPO, which needs a reward gap,
gets the `length` reward added so its groups untie.)

Each system runs in its own fresh subprocess, so peak resident memory is per system. Per
system: seconds per optimizer step (median over the steps after the first, measured between
consecutive step ends), the rollout part (time inside the generation call: astrai's
`LLMEngine.run_batch`, TRL's `_generate_single_turn`) and the rest (training), process CPU
seconds per step (the robust figure on a shared machine), rollout tokens per step, the peak RSS
of the steps (the kernel's high-water mark reset once model and optimizer are loaded) and what
the steps add to the RSS after loading. Ratios are against TRL with gradient checkpointing off
(the same work as astrai's default); TRL's default (checkpointing on) is a second row.
Two rows show the CPU matrix-product library on each side: astrai with `cpu_matmul blas`
(PyTorch's default MKL sgemm; astrai's default sends float32 products to oneDNN), and TRL with
astrai's oneDNN routing switched on in its process (`astrai.model.matmul.set_cpu_matmul`).
More rows show the C allocator's policy on each side: astrai with glibc's mmap threshold
fixed at 1 MiB (`host_mmap_threshold_mb 1`; the default keeps glibc's), and TRL with the same
fixed threshold from the environment (`MALLOC_MMAP_THRESHOLD_`); astrai with glibc's heap trim
throughout (`host_keep_heap false`; by default astrai keeps freed heap memory mapped while it
decodes), and TRL with the heap never trimmed, from the environment (`MALLOC_TRIM_THRESHOLD_`,
`MALLOC_MMAP_THRESHOLD_`).
Rows draw the rollouts ahead of training (`async_steps` 1 and 2, `rl/pipeline.py`) with the engine
in a rollout process of its own (`astrai_async1`, `astrai_async2`: `async_rollout_source` auto on a
CPU, `rl/process_sampler.py`), on the rollout thread itself (`astrai_async1_thread`), or on one
`astrai serve` process (`astrai_server_async1`): the trainer and the engine take half of `--threads`
each (at least one), so give `--threads 2` to compare every system on the same two cores;
`astrai_t1` and `trl_t1` are the synchronous loop and TRL at one thread, and the ratios take each
at its faster thread count. The `overlap` column is (rollout seconds + training seconds) / seconds
per step: 1 for a synchronous loop, up to 2 when the rollout hides entirely behind training (async
rows: training = the step less the trainer's wait). `rollout process peak MB` is the engine
process's own peak RSS (the trainer's is the `peak RSS MB` column); its CPU seconds per step follow
the trainer's after a `+`.
`reward (last step)` is the rollout reward at the last step (0 for every system while completions
are forced to full length; `--stop_at_eos` makes it comparable).

Rollouts from a server (issue 48): `astrai_server_fs` and `astrai_server_bc` run the same online
GRPO with its rollouts drawn from one `astrai serve` process (`rollout_servers`) that the child
starts beside itself, the weights sent before each rollout by the filesystem transport (publish +
`/v1/load_weights`) or the broadcast one (a gloo group); the same full-length completions
(`min_tokens` sent with each request). A second table puts them next to the colocated `astrai` row:
seconds per step, the weight sync's seconds per step (the trainer's `weight_sync_seconds`), and the
peak RSS of each process (trainer, server). The server gets `--threads` threads too, so on a
machine with fewer cores than two systems' threads the two processes share them.

    .venv/bin/python benchmarks/bench_rl.py [--quick] [--model DIR] [--steps N] [--prompts B]
        [--group_size G] [--max_tokens T] [--threads N] [--systems astrai,trl,...] [--stop_at_eos] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = {  # the demo's model shape (~1M parameters); vocab_size comes from the tokenizer
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
}
# name -> (label, train_type or "trl", gradient checkpointing); the table's row order
SYSTEMS = {
    "astrai": ("astrai online_grpo", "online_grpo", False),
    "astrai_t1": ("astrai online_grpo, one thread (the CPU default)", "online_grpo", False),
    "astrai_ckpt": ("astrai online_grpo, gradient_checkpointing", "online_grpo", True),
    "trl": ("TRL GRPOTrainer, checkpointing off", "trl", False),
    "trl_t1": ("TRL GRPOTrainer, checkpointing off, one thread", "trl", False),
    "trl_ckpt": ("TRL GRPOTrainer, checkpointing on (default)", "trl", True),
    "astrai_dpo": ("astrai online_dpo", "online_dpo", False),
    "astrai_ppo": ("astrai online_ppo", "online_ppo", False),
    # the C allocator's policy, each way on each side: astrai's rl.host_mmap_threshold_mb 1 fixes
    # glibc's mmap threshold at 1 MiB; TRL gets the same policy from the environment
    "astrai_mmap": ("astrai online_grpo, host_mmap_threshold_mb 1", "online_grpo", False),
    "trl_mmap": ("TRL GRPOTrainer, checkpointing off, MALLOC_MMAP_THRESHOLD_=1 MiB", "trl", False),
    # the heap's trim: astrai keeps freed heap memory mapped while it decodes (rl.host_keep_heap, the
    # default), glibc's default gives the heap's top back; TRL can only set it for the whole process
    "astrai_trim": ("astrai online_grpo, host_keep_heap false (glibc's trim)", "online_grpo", False),
    "trl_keep": ("TRL GRPOTrainer, checkpointing off, heap never trimmed (MALLOC_TRIM_THRESHOLD_)", "trl", False),
    # the CPU matrix-product library: astrai sends float32 products to oneDNN by default (cpu_matmul
    # auto); `blas` keeps PyTorch's MKL sgemm, which TRL uses; TRL's process can be given the same routing
    "astrai_blas": ("astrai online_grpo, cpu_matmul blas (PyTorch's default sgemm)", "online_grpo", False),
    "trl_onednn": ("TRL GRPOTrainer, checkpointing off, astrai's oneDNN products (set_cpu_matmul)", "trl", False),
    # rollouts drawn ahead on a thread beside training (rl.async_steps): the trainer and the rollout
    # thread each take half of --threads (at least one), so the system uses the cores the others do
    "astrai_async1": ("astrai online_grpo, async_steps 1 (engine in a rollout process)", "online_grpo", False),
    "astrai_async2": ("astrai online_grpo, async_steps 2 (engine in a rollout process)", "online_grpo", False),
    "astrai_async1_thread": ("astrai online_grpo, async_steps 1 (engine on the rollout thread)", "online_grpo", False),
    # rollouts from one `astrai serve` process beside the trainer, weights by each transport
    "astrai_server_fs": ("astrai online_grpo, rollouts from a server (filesystem transport)", "online_grpo", False),
    "astrai_server_bc": ("astrai online_grpo, rollouts from a server (broadcast transport)", "online_grpo", False),
    "astrai_server_async1": ("astrai online_grpo, async_steps 1, rollouts from a server (broadcast)", "online_grpo",
                             False),
}
SERVER_TRANSPORT = {"astrai_server_fs": "filesystem", "astrai_server_bc": "broadcast",
                    "astrai_server_async1": "broadcast"}
ADMIN_KEY = "bench-admin"
CHILD_ENV = {  # glibc reads these when the process starts
    "trl_mmap": {"MALLOC_MMAP_THRESHOLD_": str(2**20)},
    "trl_keep": {"MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)},
}
CHILD_FLAGS = {"astrai_mmap": {"host_mmap_threshold_mb": 1}, "astrai_trim": {"host_keep_heap": False},
               "astrai_blas": {"cpu_matmul": "blas"}, "astrai_async1": {"async_steps": 1},
               "astrai_async2": {"async_steps": 2}, "astrai_server_async1": {"async_steps": 1},
               "astrai_async1_thread": {"async_steps": 1, "async_rollout_source": "thread"}}
CHILD_THREADS = {"astrai_t1": 1, "trl_t1": 1}  # these rows take one thread whatever --threads says
TINY_DEFAULTS = {"steps": 8, "prompts": 8, "group_size": 8, "max_tokens": 16, "threads": 1, "lr": 1e-4}
MODEL_DEFAULTS = {"steps": 3, "prompts": 8, "group_size": 4, "max_tokens": 64, "threads": 2, "lr": 1e-6}
RESULT = "BENCH_RL_RESULT "  # the child's last stdout line: this prefix, then its JSON summary


def write_tiny_model(model_dir: Path, corpus: list[str], seed: int) -> None:
    """A fresh tiny model directory (weights + tokenizer with its chat template)."""
    from astrai.data.tokenizer_training import train_tokenizer
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM

    tok = train_tokenizer(corpus + ["user assistant system"] * 5, 384)
    save_model(CausalLM(ModelConfig(vocab_size=tok.vocab_size, **MODEL), seed=seed), model_dir, tokenizer=tok)


def setup(tmp: Path, num_prompts: int, seed: int, model: Path | None) -> tuple[Path, Path]:
    """Prompt records, and the model directory: `model`, or a fresh tiny one written under `tmp`."""
    from astrai.data.tasks import write_task_files

    files = write_task_files(tmp / "data", num_train=max(num_prompts, 256), num_eval=8, digits=2, seed=seed)
    if model is not None:
        return files["prompts"], model
    corpus = [json.loads(line)["text"] for line in files["corpus"].read_text().splitlines()]
    write_tiny_model(tmp / "model", corpus, seed)
    return files["prompts"], tmp / "model"


# ---------------------------------------------------------------------------- one system (child process)


def force_full_length() -> None:
    """Every astrai rollout request gets min_tokens = max_tokens: no end token before the budget
    (patched on the engine's public `run_batch`, the one call the rollout runner makes)."""
    from astrai.infer.engine import LLMEngine

    run_batch = LLMEngine.run_batch

    def full_length(self: Any, prompt_ids: list[list[int]], params: Any = None, **kw: Any) -> Any:
        listed = params if isinstance(params, list) else [params] * len(prompt_ids)
        return run_batch(self, prompt_ids, [dataclasses.replace(p, min_tokens=p.max_tokens) for p in listed], **kw)

    LLMEngine.run_batch = full_length


def serve_turns_full_length(*args: Any) -> None:
    """The rollout process's main (``async_rollout_source process``) with full-length completions:
    a spawned child imports this script afresh, so the patch is made there first."""
    from astrai.train.rl import process_sampler

    force_full_length()
    process_sampler.serve_turns(*args)  # the child's own module, unpatched


def force_full_length_process() -> None:
    """The same full-length completions from the rollout process: its main is the one above."""
    from astrai.train.rl import process_sampler

    process_sampler.serve_turns = serve_turns_full_length


def force_full_length_remote() -> None:
    """The same full-length completions from a rollout server: min_tokens = max_tokens in every
    sampling request the HTTP sampler sends (patched on its one HTTP call)."""
    from astrai.train.rl.http_sampler import HttpSampler

    call = HttpSampler._call

    def full_length(self: Any, url: str, method: str, route: str, what: str, body: Any = None, **kw: Any) -> Any:
        if route == "/v1/completions":
            body = {**body, "min_tokens": body["max_tokens"]}
        return call(self, url, method, route, what, body, **kw)

    HttpSampler._call = full_length


def start_server(model_dir: Path, weights: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """One `astrai serve` of `model_dir` (fp32, admin route on, reproducible engine settings), healthy."""
    import time

    import httpx

    from astrai.train.launch import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "astrai", "serve", "--model", str(model_dir), "--port", str(port), "--admin_key",
           ADMIN_KEY, "--weights_dir", str(weights), "--dtype", "float32", "--num_threads", str(threads),
           "--long_prefill_token_threshold", "0", "--linear_layout", "out_in", "--log_level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bench_rl: the rollout server exited with {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("bench_rl: the rollout server was not healthy within 600 s")


def cpu_seconds(pid: int) -> float:
    """A live process's CPU seconds so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (VmHWM) while it is alive."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_astrai(prompts: Path, model_dir: Path, out: Path, args: argparse.Namespace, train_type: str,
               checkpointing: bool, extra_flags: dict[str, Any] | None = None) -> dict[str, float]:
    from trl_common import StepClock, StepMemory

    from astrai.config import load_config
    from astrai.train.rl.loop import OnlineLoop

    clock, memory = StepClock(), StepMemory()
    waits: list[float] = []  # async_steps: seconds the trainer waited for its rollout
    rewards: list[float] = []
    sync_seconds: list[float] = []
    child_peak: list[float] = []
    child_cpu: list[float] = []  # the rollout process's CPU seconds at each step's end
    if not args.stop_at_eos:
        force_full_length()
        force_full_length_process()
        force_full_length_remote()

    class Clock:
        requested_metrics = frozenset()

        def on_train_begin(self, loop: Any) -> None:
            memory.start()
            clock.start()

        def after_optimizer_step(self, loop: Any) -> None:
            clock.tick()
            memory.tick()
            clock.rollout_seconds.append(loop.step_metrics["rollout_seconds"])
            clock.rollout_tokens.append(int(loop.step_metrics["rollout_tokens"]))
            waits.append(loop.step_metrics.get("async_wait_seconds", float("nan")))
            rewards.append(loop.step_metrics["reward_mean"])
            sync_seconds.append(float(loop.step_metrics.get("weight_sync_seconds", 0.0)))
            if loop.pipeline is not None and hasattr(loop.pipeline.runner.sampler, "process"):  # the rollout process
                child_peak.append(peak_rss_mb(loop.pipeline.runner.sampler.process.pid))
                child_cpu.append(cpu_seconds(loop.pipeline.runner.sampler.process.pid))

    reward_names = "exact_match,length" if train_type == "online_dpo" and not args.stop_at_eos else "exact_match"
    flags = {"train_type": train_type, "data_path": prompts, "param_path": model_dir, "device": "cpu",
             "batch_per_device": args.prompts, "group_size": args.group_size, "rollout_max_tokens": args.max_tokens,
             "rollout_temperature": 1.0, "max_steps": args.steps, "n_epoch": 100, "max_lr": args.lr,
             "schedule": "constant", "max_grad_norm": 1.0, "kl_coef": 0.0, "clip_eps": 0.2,
             "rl_loss_agg": "token_mean", "random_seed": args.seed, "ckpt_dir": out / "ckpt", "ckpt_interval": 0,
             "log_dir": out, "progress": False, "gradient_checkpointing": checkpointing, "rewards": reward_names,
             **(extra_flags or {})}
    cfg = load_config(None, [item for k, v in flags.items() for item in (f"--{k}", str(v))])
    OnlineLoop(cfg, callbacks=[Clock()]).train()
    # async_steps k: the first k + 1 rollouts are all drawn from the starting weights, back to back,
    # so steps 2..k + 1 find theirs ready, and the last k steps draw nothing beside them; the steady
    # state (the longer of generation and training) lies between
    k, n = cfg.rl.async_steps, len(clock.rollout_seconds)
    clock.stamps = clock.stamps[k:len(clock.stamps) - k]
    clock.rollout_seconds, clock.rollout_tokens = clock.rollout_seconds[k:n - k], clock.rollout_tokens[k:n - k]
    waits = waits[k:n - k]
    synced = sync_seconds[k + 1:n - k] or sync_seconds  # as the step times: the first step's aside
    out = {**clock.summary(), **memory.summary(), "reward_last": rewards[-1],
           "sync_s": sum(synced) / max(len(synced), 1)}
    if child_peak:
        out["engine_peak_rss_mb"] = max(child_peak)
        window = child_cpu[k:len(child_cpu) - k]  # the step ends the step times come from
        steps = [b - a for a, b in zip(window, window[1:])]
        out["engine_cpu_s"] = statistics.median(steps) if steps else float("nan")
    if cfg.rl.async_steps and len(waits) > 1:  # the trainer is busy for the step less its wait
        out["train_s"] = out["step_s"] - statistics.median(waits[1:])
    out["overlap"] = (out.get("rollout_s", 0.0) + out.get("train_s", 0.0)) / out["step_s"]
    return out


def run_trl(prompts: Path, model_dir: Path, out: Path, args: argparse.Namespace, checkpointing: bool) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer
    from trl_common import StepClock, StepMemory, exact_match, grpo_config, prompt_dataset, time_generation

    clock, memory = StepClock(), StepMemory()

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            memory.start()
            clock.start()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.tick()
            memory.tick()

    config = grpo_config(out, steps=args.steps, prompts=args.prompts, group_size=args.group_size,
                         max_tokens=args.max_tokens, lr=args.lr, seed=args.seed, checkpointing=checkpointing,
                         min_tokens=0 if args.stop_at_eos else args.max_tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=prompt_dataset(prompts),
                          processing_class=tokenizer, callbacks=[Clock()])
    time_generation(trainer, clock)
    trainer.train()
    out = {**clock.summary(), **memory.summary()}
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    out["reward_last"] = rewards[-1] if rewards else float("nan")
    out["overlap"] = (out.get("rollout_s", 0.0) + out.get("train_s", 0.0)) / out["step_s"]
    return out


def child(args: argparse.Namespace) -> int:
    import torch

    flags = CHILD_FLAGS.get(args.child) or {}
    # async_steps: the trainer's threads and the rollout thread's (the same count) share --threads
    torch.set_num_threads(max(1, args.threads // 2) if flags.get("async_steps") else args.threads)
    _, train_type, checkpointing = SYSTEMS[args.child]
    out = Path(args.out)
    if args.child == "trl_onednn":
        from astrai.model.matmul import set_cpu_matmul

        set_cpu_matmul("onednn")  # process-wide: transformers' and TRL's products too
    if train_type == "trl":
        result = run_trl(Path(args.prompts_path), Path(args.model_dir), out, args, checkpointing)
    elif args.child in SERVER_TRANSPORT:  # one server process beside this trainer process
        weights = out / "weights"
        weights.mkdir(parents=True, exist_ok=True)
        server, url = start_server(Path(args.model_dir), weights, max(1, args.threads // 2) if flags else args.threads)
        try:
            flags = {**flags, "rollout_servers": url, "rollout_admin_key": ADMIN_KEY, "rollout_weights_dir": weights,
                     "rollout_weight_transport": SERVER_TRANSPORT[args.child]}
            result = run_astrai(Path(args.prompts_path), Path(args.model_dir), out, args, train_type, checkpointing,
                                flags)
            result["server_peak_rss_mb"] = peak_rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(60)
    else:
        result = run_astrai(Path(args.prompts_path), Path(args.model_dir), out, args, train_type, checkpointing,
                            CHILD_FLAGS.get(args.child))
    print(RESULT + json.dumps(result), flush=True)
    return 0


def run_child(name: str, prompts: Path, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """One system in a fresh interpreter; its summary from the last stdout line."""
    cmd = [sys.executable, __file__, "--child", name, "--prompts_path", str(prompts), "--model_dir", str(model_dir),
           "--out", str(out), "--steps", str(args.steps), "--prompts", str(args.prompts),
           "--group_size", str(args.group_size), "--max_tokens", str(args.max_tokens), "--lr", str(args.lr),
           "--threads", str(CHILD_THREADS.get(name, args.threads)), "--seed", str(args.seed)] + (["--stop_at_eos"] if args.stop_at_eos else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CHILD_ENV.get(name, {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_rl: system {name!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


# ---------------------------------------------------------------------------- the table


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and b == b and a == a else "-"


def print_table(results: dict[str, dict[str, float]], args: argparse.Namespace, model_name: str) -> None:
    length = "stop at EOS" if args.stop_at_eos else "every completion forced to full length"
    print(f"Online RL on {model_name}: {args.prompts} prompts x {args.group_size} completions, {args.max_tokens} new "
          f"tokens ({length}), {args.steps} steps (median of steps 2..{args.steps}; async_steps k: of steps k + 2..steps - k), "
          f"{args.threads} thread(s) per system (async: half for training, half for the rollout thread), CPU fp32, "
          "each system in its own process.\n")
    print("| system | s/step | rollout s | train s | overlap | CPU s/step | tokens/step | peak RSS MB | step adds MB "
          "| rollout process peak MB | reward (last step) | s/step vs TRL | CPU vs TRL | peak vs TRL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    trl = [results[n] for n in ("trl", "trl_t1") if n in results]
    ref = min(trl, key=lambda r: r["step_s"]) if trl else {}  # TRL at its best thread count
    for name, r in results.items():
        cells = [f"{r['step_s']:.3f}", f"{r.get('rollout_s', float('nan')):.3f}", f"{r.get('train_s', float('nan')):.3f}",
                 f"{r.get('overlap', float('nan')):.2f}",
                 f"{r['cpu_s']:.3f}" + (f" + {r['engine_cpu_s']:.3f}" if "engine_cpu_s" in r else ""),
                 f"{r.get('tokens_per_step', float('nan')):.0f}", f"{r['peak_rss_mb']:.0f}", f"{r['step_rss_mb']:.0f}",
                 f"{r['engine_peak_rss_mb']:.0f}" if "engine_peak_rss_mb" in r else "-",
                 f"{r.get('reward_last', float('nan')):.3f}", ratio(r["step_s"], ref.get("step_s", 0)),
                 ratio(r["cpu_s"], ref.get("cpu_s", 0)), ratio(r["peak_rss_mb"], ref.get("peak_rss_mb", 0))]
        print(f"| {SYSTEMS[name][0]} | " + " | ".join(cells) + " |")
    if "astrai" in results and ref:
        a, target = results["astrai"], 2 if args.model else 3
        print(f"\nTargets against TRL (checkpointing off, its faster thread count): {target}x faster per step -> at most "
              f"{ref['step_s'] / target:.3f} s (astrai: {a['step_s']:.3f} s, {ref['step_s'] / a['step_s']:.2f}x; "
              f"CPU {ref['cpu_s'] / a['cpu_s']:.2f}x); peak RSS at most 0.5x -> {ref['peak_rss_mb'] / 2:.0f} MB "
              f"(astrai: {a['peak_rss_mb']:.0f} MB, {a['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x).")
    sync_rows = [results[n] for n in ("astrai", "astrai_t1") if n in results]
    for name in ("astrai_async1", "astrai_async2", "astrai_async1_thread", "astrai_server_async1"):  # vs synchronous
        if name in results and sync_rows:
            sync = min(sync_rows, key=lambda r: r["step_s"])  # the synchronous loop at its best thread count
            fast = results[name]
            line = (f"{SYSTEMS[name][0]}: {sync['step_s'] / fast['step_s']:.2f}x the synchronous loop's steps/s "
                    f"at its faster thread count (target for async_steps 1 on a real model: 1.6x)")
            if ref:
                line += f", {ref['step_s'] / fast['step_s']:.2f}x TRL's per step (target on the tiny model: 3x)"
            print(line)
    if "astrai_t1" in results and sync_rows:  # what overlap can do at all on this machine's two cores
        one, best = results["astrai_t1"], min(sync_rows, key=lambda r: r["step_s"])["step_s"]
        phases = [one.get("rollout_s", float("nan")), one.get("train_s", float("nan"))]
        print(f"2-core bound: a step is {one['step_s']:.3f} s of work at one thread per phase (astrai_t1), so no "
              f"overlap on two cores beats {one['step_s'] / 2:.3f} s ({2 * best / one['step_s']:.2f}x the "
              f"synchronous loop at its faster thread count); one core per phase (async_steps): at least the "
              f"longer phase, {max(phases):.3f} s ({best / max(phases):.2f}x)")
    served = [name for name in SERVER_TRANSPORT if name in results]
    if served:  # rollouts from a server next to the colocated run
        print("\nRollouts from one `astrai serve` process beside the trainer process vs the colocated run (same "
              "machine; CPU s/step and the RSS columns above count the trainer process only):\n")
        print("| system | s/step | weight sync s/step | trainer peak RSS MB | server peak RSS MB | s/step vs colocated |")
        print("|---|---|---|---|---|---|")
        base = results.get("astrai", {})
        for name in (["astrai"] if base else []) + served:
            r = results[name]
            server_mb = r.get("server_peak_rss_mb")
            print(f"| {SYSTEMS[name][0]} | {r['step_s']:.3f} | {r.get('sync_s', 0.0):.3f} | {r['peak_rss_mb']:.0f} | "
                  f"{'-' if server_mb is None else f'{server_mb:.0f}'} | {ratio(r['step_s'], base.get('step_s', 0))} |")
    if "astrai" in results and "astrai_ppo" in results:  # what the critic costs
        g, p = results["astrai"], results["astrai_ppo"]
        print(f"online_ppo / online_grpo: {p['step_s'] / g['step_s']:.2f}x per step, training part "
              f"{p.get('train_s', 0) / max(g.get('train_s', 0), 1e-9):.2f}x (the critic's forward, backward and "
              "optimizer); TRL 1.x ships no PPO trainer, so there is no TRL row for it.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps of 2 prompts (smoke test)")
    parser.add_argument("--model", type=Path, help="an HF model directory (default: a fresh tiny model)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    for name in ("steps", "prompts", "group_size", "max_tokens", "threads"):
        parser.add_argument(f"--{name}", type=int, help=f"default {TINY_DEFAULTS[name]} (tiny), "
                            f"{MODEL_DEFAULTS[name]} (--model)")
    parser.add_argument("--lr", type=float, help="default 1e-4 (tiny), 1e-6 (--model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop_at_eos", action="store_true", help="let completions end early (lengths may differ)")
    parser.add_argument("--json", type=Path, help="also write the settings and every system's figures here")
    for hidden in ("--child", "--prompts_path", "--model_dir", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in (MODEL_DEFAULTS if args.model else TINY_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.steps, args.prompts = 3, 2
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass an HF model directory "
                     "(e.g. .cache/smollm2 from `make real-model`)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    try:
        import trl  # noqa: F401
    except ImportError as e:
        print(f"bench_rl: TRL is not installed ({e}); install the dev extra: pip install -e '.[dev]'",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model.resolve() if args.model else None
        prompts, model_dir = setup(tmp, args.prompts * args.steps, args.seed, model)
        results = {}
        for name in args.systems.split(","):
            print(f"bench_rl: running {name} ...", file=sys.stderr, flush=True)
            r = results[name] = run_child(name, prompts, model_dir, tmp / name, args)
            print(f"bench_rl: {name}: {r['step_s']:.3f} s/step, {r['cpu_s']:.3f} CPU s/step, peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    print_table(results, args, args.model.name if args.model else "a fresh tiny model")
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    if k not in ("child", "prompts_path", "model_dir", "out", "json")}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
