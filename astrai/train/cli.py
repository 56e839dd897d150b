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

import argparse
import copy
import json
import os
import sys
from pathlib import Path

from astrai.config import Config, ConfigError, load_config
from astrai.train.context import TrainContext

USAGE = """astrai train --config run.yaml [--key value ...] [--dry_run]

Any config field is a flag (snake_case, as in the YAML; the section is optional): e.g.
  --train_type sft --data_path data/train.jsonl --max_lr 3e-4 --batch_per_device 8
  --param_path DIR      initialise from a model or checkpoint directory (weights only)
  --resume              restore the full training state (from --param_path or the newest
                        complete checkpoint in --ckpt_dir)
  --nprocs N            run N local ranks (gloo on CPU, nccl on CUDA)
"""


def _fail(message: str, code: int = 2) -> int:
    print(f"astrai train: error: {message}", file=sys.stderr)
    return code


TRAINING_STATE_FILES = ("trainer_state.json", "manifest.json", "optimizer.pt")


def resume_path(cfg: Config) -> Path:
    """The checkpoint ``--resume`` continues from: param_path when it names one training
    checkpoint, else the latest in ckpt_dir. A param_path that is a model directory or another
    run's ckpt_dir is this run's initial weights (a chained stage), not a state to resume."""
    from astrai.train.checkpoint import find_resume_checkpoint

    if cfg.train.param_path is not None:
        path = Path(cfg.train.param_path)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume from param_path {str(path)!r}: no such checkpoint directory")
        if any((path / name).exists() for name in TRAINING_STATE_FILES):
            return path
    # the newest complete one; raises naming the damaged file when checkpoints exist but none is complete
    return find_resume_checkpoint(cfg.ckpt.ckpt_dir)


def initial_config(cfg: Config, ckpt: Path) -> Config:
    """On resume, the model is first built as the original run built it (its ``model:`` section or
    its param_path), so DPO's frozen reference is the original initial policy; the checkpoint's
    weights are loaded over it afterwards."""
    out = copy.deepcopy(cfg)
    state_file = ckpt / "trainer_state.json"
    saved: dict = {}
    if state_file.is_file():
        try:
            saved = json.loads(state_file.read_text()).get("config", {})
        except json.JSONDecodeError:
            saved = {}  # load_training_checkpoint reports the corrupt file by name
    init_path = saved.get("train", {}).get("param_path")
    out.train.param_path = init_path if init_path and Path(init_path).is_dir() else None
    out.model = dict(saved.get("model") or cfg.model)
    if out.train.param_path is None and not out.model:
        out.train.param_path = str(ckpt)  # no record of the initial model: start from the checkpoint
    return out


def run(cfg: Config, ctx: TrainContext) -> int:
    from astrai.train import dist
    from astrai.train.checkpoint import CheckpointError, cleanup_leftovers
    from astrai.train.trainer import Trainer

    info = dist.init_distributed(cfg.train.device)
    found: tuple[str | None, str | None] = (None, None)  # (checkpoint path, error), decided by rank 0
    if info.rank == 0:
        cleanup_leftovers(cfg.ckpt.ckpt_dir)  # staging dirs of a killed save; half-done republishes
        if cfg.train.resume:
            try:
                found = (str(resume_path(cfg)), None)
            except (FileNotFoundError, CheckpointError) as e:
                found = (None, str(e))  # raised on every rank below, so no rank waits alone
    found = dist.broadcast_object(found)  # every rank resumes from the same checkpoint
    if found[1] is not None:
        raise FileNotFoundError(found[1])
    resume_from = Path(found[0]) if found[0] is not None else None
    build_cfg = initial_config(cfg, resume_from) if resume_from else cfg
    trainer = Trainer(build_cfg, ctx=ctx)
    if resume_from is not None:
        from astrai.train.checkpoint import load_training_checkpoint

        state = load_training_checkpoint(resume_from, model=trainer.raw_model, optimizer=trainer.optimizer,
                                         scheduler=trainer.scheduler, verify=True,
                                         metrics_path=Path(cfg.log.log_dir) / "metrics.jsonl")
        trainer.load_state_dict(state)
        if trainer.is_main:
            print(f"resumed from {resume_from} at step {ctx.step}", file=sys.stderr)
    try:
        trainer.train()
    finally:
        dist.cleanup()
    if ctx.stop_requested and trainer.is_main:
        saved = "checkpoint published" if ctx.step > 0 else "no optimizer step completed, nothing to save"
        print(f"stopped at step {ctx.step} ({ctx.stop_reason}); {saved}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ctx = TrainContext()
    from astrai.train import signals

    signals.install_signal_handlers(ctx)  # before anything slow: a signal during setup is kept

    parser = argparse.ArgumentParser(prog="astrai train", usage=USAGE, allow_abbrev=False, add_help=True)
    parser.add_argument("--config", default=None, help="YAML file with model/data/train/optim/... sections")
    parser.add_argument("--dry_run", action="store_true", help="print the resolved config and exit")
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as e:
        return _fail(str(e))
    if args.dry_run:
        print(cfg.to_yaml(), end="")
        return 0
    if cfg.dist.nprocs > 1 and "WORLD_SIZE" not in os.environ:
        from astrai.train.launch import launch

        return launch(["train", *argv], cfg.dist.nprocs, stop_timeout=cfg.train.stop_timeout)
    try:
        return run(cfg, ctx)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(str(e), 1)
    except Exception as e:  # a checkpoint error names its file; keep the message, not a traceback
        if type(e).__name__ in ("CheckpointError", "HFFormatError"):
            return _fail(str(e), 1)
        raise
