"""``astrai train --config run.yaml [--key value ...]``: config -> (launcher) -> Trainer -> exit code.

The entry of the training data flow. Signal handlers are installed first, so a SIGTERM during
the (slow) model and data setup is remembered and honoured at the first batch boundary. The
config is resolved (flag > YAML > default); ``--dry_run`` prints it and exits. With
``--nprocs N`` and no rank environment the local launcher starts N ranks running this same
command; under ``torchrun`` (or as a launched rank) the trainer joins the process group itself.
``--resume`` continues from ``--param_path`` or the newest complete checkpoint in ``ckpt_dir``.
A graceful stop (signal, early stopping) publishes a checkpoint and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from contextlib import nullcontext
from typing import Any

import yaml

from astrai.config import SECTIONS, Config, ConfigError, load_config
from astrai.config_values import type_name
from astrai.flags import ArgumentParser, RawEpilogHelpFormatter
from astrai.train.context import TrainContext

USAGE = """astrai train --config run.yaml [--key value ...] [--dry_run]

Any config field listed below is a flag, snake_case as in the YAML or kebab-case (vLLM's); the
section is optional; a boolean takes --pack, --pack false or --no-pack. For example:
  --train_type sft --data_path data/train.jsonl --max-lr 3e-4 --batch_per_device 8
  --param_path DIR      initialise from a model or checkpoint directory (weights only)
  --resume              restore the full training state (from --param_path or the newest
                        complete checkpoint in --ckpt_dir)
  --nprocs N            run N local ranks (gloo on CPU, nccl on CUDA)
  --rollout_replicas N  also start N local `astrai serve` replicas that draw the rollouts
  --num_threads N       torch intra-op threads per rank (alias --threads; default OMP_NUM_THREADS
                        when set, else 1 on CPU)
"""

# A CPU run's torch intra-op threads unless --num_threads says otherwise. Measured on the 2-core
# dev machine (docs/training.md, "Threads"): one thread ran the tour's SFT faster than two, and
# two threads on a busy box ran it several times slower; a larger model gains from more threads,
# which --num_threads gives.
DEFAULT_CPU_THREADS = 1


def _fail(message: str, code: int = 2) -> int:
    print(f"astrai train: error: {message}", file=sys.stderr)
    return code


def optimizer_summary(cfg: Config, total_steps: int) -> str:
    """The run's first line: the effective learning rate, schedule and warmup, and where a
    situation-dependent default came from."""
    o = cfg.optim
    warmup = o.warmup_steps if o.warmup_steps is not None else round(o.warmup_ratio * total_steps)
    why = {k: f" (default for {v}; set --{k} to change)" for k, v in cfg.filled_defaults.items()}
    return (f"optimizer {o.optimizer}: max_lr={o.max_lr:g}{why.get('max_lr', '')}, schedule={o.schedule}, "
            f"warmup={warmup} of {total_steps} steps{why.get('warmup_ratio', '')}")


def set_threads(cfg: Config, asked: int | None) -> str:
    """Set torch's intra-op threads before the model is built (each rank parses its own command
    line, so a multi-rank launch sets it per rank); returns the start line that says so."""
    import torch

    on_cpu = (cfg.train.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if asked is not None:
        torch.set_num_threads(asked)
        why = "--num_threads"
    elif omp.isdigit() and int(omp) > 0:  # the user's, or the local launcher's share of the cores per rank
        torch.set_num_threads(int(omp))
        why = "OMP_NUM_THREADS; --num_threads N to change"
    elif on_cpu:
        torch.set_num_threads(DEFAULT_CPU_THREADS)
        why = "the CPU default; --num_threads N to change"
    else:
        why = "torch's default on CUDA; --num_threads N to change"
    return f"threads: {torch.get_num_threads()} (torch intra-op per rank; {why})"


def run(cfg: Config, ctx: TrainContext, threads_line: str = "") -> int:
    from astrai.config_values import is_online
    from astrai.train import dist, resume
    from astrai.train.checkpoint import prepare_ckpt_dir
    from astrai.train.optim import warmup_warning
    from astrai.train.publish import run_lock
    from astrai.train.rl.loop import OnlineLoop
    from astrai.train.trainer import Trainer

    info = dist.init_distributed(cfg.train.device)
    with run_lock(cfg.ckpt.ckpt_dir) if info.rank == 0 else nullcontext():  # one run per ckpt_dir
        prepare_ckpt_dir(cfg)  # a killed save's leftovers; a used ckpt_dir needs --resume or --overwrite_ckpt_dir
        ckpt = resume.find(cfg)
        build_cfg = resume.initial_config(cfg, ckpt) if ckpt else cfg
        loop = OnlineLoop(build_cfg, ctx=ctx) if is_online(cfg.data.train_type) else Trainer(build_cfg, ctx=ctx)
        if ckpt is not None:
            resume.restore(loop, ckpt)
        if loop.is_main:
            print(optimizer_summary(cfg, loop.total_steps), file=sys.stderr)
            if (warning := warmup_warning(cfg.optim, loop.total_steps)) is not None:
                print(warning, file=sys.stderr)
            if threads_line:
                print(threads_line, file=sys.stderr)
        try:
            loop.train()  # ends with the run's summary (train/summary.py): how it ended, losses, checkpoint
        finally:
            dist.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # under --rollout_replicas the trainer's command line has the launcher's additions; the run
    # summary's resume line shows the user's own (train/replicas.py passes it)
    shown = os.environ.get("ASTRAI_REPLICAS_ARGV")
    ctx = TrainContext(command=json.loads(shown) if shown else argv)
    from astrai.train import signals

    signals.install_signal_handlers(ctx)  # before anything slow: a signal during setup is kept

    wants_help = any(a in ("-h", "--help") for a in argv)  # the fields' table reads every dataclass's source
    parser = ArgumentParser(prog="astrai train", usage=USAGE, allow_abbrev=False, add_help=True,
                            epilog=fields_help() if wants_help else None, formatter_class=RawEpilogHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file with model/data/train/optim/... sections")
    parser.add_argument("--dry_run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--num_threads", "--threads", type=int, default=None, metavar="N",
                        help=f"torch intra-op threads per rank (default {DEFAULT_CPU_THREADS} on CPU)")
    args, rest = parser.parse_known_args(argv)
    if args.num_threads is not None and args.num_threads < 1:
        return _fail(f"--num_threads must be >= 1, got {args.num_threads}")
    try:
        cfg = load_config(args.config, rest)
        from astrai.train.advantages import check_group_size

        check_group_size(cfg.rl)  # the estimator's table is train's: checked here, before any rank starts
    except ConfigError as e:
        return _fail(str(e))
    if args.dry_run:
        print(cfg.to_yaml(), end="")
        return 0
    if cfg.rl.rollout_replicas > 0 and "WORLD_SIZE" not in os.environ:
        from astrai.train.replicas import launch_with_replicas

        try:
            return launch_with_replicas(argv, cfg)
        except (ValueError, FileNotFoundError, OSError) as e:
            return _fail(str(e), 1)
    if cfg.dist.nprocs > 1 and "WORLD_SIZE" not in os.environ:
        from astrai.train.launch import launch

        return launch(["train", *argv], cfg.dist.nprocs, stop_timeout=cfg.train.stop_timeout)
    import torch

    threads = torch.get_num_threads()  # restored after: an in-process caller (the demo, tests) keeps its own
    try:
        threads_line = set_threads(cfg, args.num_threads)  # before the model is built
        return run(cfg, ctx, threads_line)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(str(e), 1)
    except Exception as e:  # these name their file or cause; keep the message, not a traceback
        if type(e).__name__ in ("CheckpointError", "HFFormatError", "CkptDirLocked", "NonFiniteError"):
            return _fail(str(e), 1)
        raise
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- --help


def _field_comments(cls: type) -> dict[str, str]:
    """field -> its trailing ``# comment`` in the dataclass source (the field's meaning), when the
    source is available."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found = re.findall(r"^\s+(\w+): [^#\n]*#\s*(.*)$", source, flags=re.MULTILINE)
    return dict(found)


def _yaml_scalar(value: Any) -> str:
    """A default as YAML writes it: null, true, 0.001, [exact_match]."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def fields_help() -> str:
    """Every config field by YAML section, with its type, default, meaning and range; generated from the
    dataclasses (what ``astrai train --help`` prints after its usage)."""
    from astrai.model.config import ModelConfig

    lines = ["config fields by YAML section: name, type, default, meaning (in full: docs/training.md)"]
    rows: list[tuple[str, ...]] = []  # (section,) headers and (name, type, default, meaning) rows
    for section, cls in {"model": ModelConfig, **SECTIONS}.items():
        hints, comments = typing.get_type_hints(cls), _field_comments(cls)
        rows.append((f"{section}:" + (" (a model built from scratch; omit with param_path)" if section == "model"
                                      else ""),))
        for f in dataclasses.fields(cls):
            if not f.name.startswith("_"):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                within = f.metadata.get("range")  # a knob's range (astrai.flags), as config_checks enforces it
                meaning = " ".join(filter(None, [comments.get(f.name, ""), f"(range: {within.text()})" if within else ""]))
                rows.append((f.name, type_name(hints[f.name]), _yaml_scalar(default), meaning))
    widths = [min(max(len(r[i]) for r in rows if len(r) > 1), cap) for i, cap in enumerate((32, 22, 14))]
    for row in rows:
        if len(row) == 1:
            lines += ["", row[0]]
        else:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    return "\n".join(line.rstrip() for line in lines) + "\n"
