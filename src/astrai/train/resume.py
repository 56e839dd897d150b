"""Resume: which checkpoint a run continues from, how its loop is rebuilt, and how state returns.

One function per question, called by any loop's entry (``train/cli.py``): ``find`` picks the
checkpoint (``--param_path`` when it names a training checkpoint, else the newest complete one
in ``ckpt_dir`` as ``checkpoint.checkpoint_to_resume`` finds it; rank 0 decides, every rank gets
the same answer); ``initial_config`` rebuilds the model as the original run built it (so a
frozen reference is the original initial policy); ``restore`` loads weights, optimizer,
schedule, the loop's extra state (e.g. the PPO critic), its counters, sampler and RNG, each
rank's own state (online RL: the rollout that rank drew, and its RNG) from that rank's file, and
continues metrics.jsonl at the restored step. The RNG helpers and the resume-mismatch report
live here too, so every loop saves and checks the same.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from astrai.config import Config
from astrai.train import dist
from astrai.train.context import Loop

TRAINING_STATE_FILES = ("trainer_state.json", "manifest.json", "optimizer.pt")


def resume_path(cfg: Config) -> Path:
    """The checkpoint ``--resume`` continues from: param_path when it names one training
    checkpoint, else the latest in ckpt_dir. A param_path that is a model directory or another
    run's ckpt_dir is this run's initial weights (a chained stage), not a state to resume."""
    from astrai.model.hub import is_hub_id
    from astrai.train.checkpoint import checkpoint_to_resume

    if cfg.train.param_path is not None and not is_hub_id(cfg.train.param_path):  # a Hub model is no checkpoint
        path = Path(cfg.train.param_path)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume from param_path {str(path)!r}: no such checkpoint directory")
        if any((path / name).exists() for name in TRAINING_STATE_FILES):
            return path
    # the newest complete one; raises naming the damaged file when checkpoints exist but none is complete
    return checkpoint_to_resume(cfg.ckpt.ckpt_dir)


def find(cfg: Config) -> Path | None:
    """The checkpoint to resume from (None without --resume), the same on every rank."""
    from astrai.train.publish import CheckpointError

    if not cfg.train.resume:
        return None
    found: tuple[str | None, str | None] = (None, None)  # (checkpoint path, error), decided by rank 0
    if dist.get_rank() == 0:
        try:
            found = (str(resume_path(cfg)), None)
        except (FileNotFoundError, CheckpointError) as e:
            found = (None, str(e))  # raised on every rank below, so no rank waits alone
    found = dist.broadcast_object(found)
    if found[1] is not None:
        raise FileNotFoundError(found[1])
    return Path(found[0])


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
    if cfg.model and saved.get("model"):
        check_model(cfg.model, saved["model"], ckpt)
    out.model = dict(saved.get("model") or cfg.model)
    if out.train.param_path is None and not out.model:
        out.train.param_path = str(ckpt)  # no record of the initial model: start from the checkpoint
    return out


def check_model(asked: dict[str, Any], saved: dict[str, Any], ckpt: Path) -> None:
    """A resume trains the checkpoint's model. A ``model`` section whose fields give other weight
    shapes (hidden size, layers, vocabulary, KV heads, ...) cannot be that model: an error naming
    each differing field with both values. Other differences (e.g. rope_theta) are ignored, with a
    warning on rank 0. Both sections are resolved first, so a default written out is no change."""
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM

    new, old = ModelConfig.from_dict(asked).to_dict(), ModelConfig.from_dict(saved).to_dict()
    diff = [k for k in new if new[k] != old.get(k)]
    if not diff:
        return
    # the fields either section writes out; the derived ones (head_dim from hidden_size) only when nothing else differs
    diff = [k for k in diff if k in asked or k in saved] or diff
    shapes = [{n: tuple(p.shape) for n, p in CausalLM(ModelConfig.from_dict(c), seed=None, device="meta")
               .named_parameters()} for c in (asked, saved)]
    fields = ", ".join(f"{k}={new[k]!r} (checkpoint: {old.get(k)!r})" for k in diff)
    if shapes[0] != shapes[1]:
        raise ValueError(f"--resume: the model section asks for {fields}, a model of other weight shapes than "
                         f"{ckpt}'s; a resumed run trains the checkpoint's model: set these fields back (or remove "
                         "them), or train the new shape as a new run with another --ckpt_dir")
    if dist.get_rank() == 0:
        print(f"warning: model fields {fields} are ignored on resume; the checkpoint's model is trained",
              file=sys.stderr)


def restore(loop: Loop, ckpt: Path) -> None:
    """Load a training checkpoint into a freshly built loop: everything an exact resume needs."""
    from astrai.train.checkpoint import load_extra_state, load_training_checkpoint

    cfg = loop.config
    # the optimizer's saved hyperparameters (lr, betas, weight decay) would override this run's
    # config; the config wins, so a changed --max_lr on resume is applied, not silently dropped
    configured = [{k: v for k, v in g.items() if k != "params"} for g in loop.optimizer.param_groups]
    state = load_training_checkpoint(ckpt, model=loop.raw_model, optimizer=loop.optimizer,
                                     scheduler=loop.scheduler, verify=True,
                                     metrics_path=Path(cfg.log.log_dir) / "metrics.jsonl")
    check_not_past_end(int(state.get("step", 0)), loop.total_steps, cfg, ckpt)
    for group, values in zip(loop.optimizer.param_groups, configured, strict=True):
        group.update(values)
    loop.scheduler.apply()
    extras = loop.extra_state()
    if extras:
        loop.load_extra_state({name: load_extra_state(ckpt, name) for name in extras})
    loop.load_state_dict(state)
    restore_rank_state(loop, ckpt, int(state.get("world_size", 1)))  # after the RNG: a rank's own wins
    if loop.is_main:
        print(f"resumed from {ckpt} at step {loop.ctx.step}", file=sys.stderr)


def check_not_past_end(step: int, total_steps: int, cfg: Config, ckpt: Path) -> None:
    """A checkpoint past this run's last step has nothing to resume: an error saying how to extend
    the run (a checkpoint at exactly the last step resumes to "finished", as a restarted
    container does)."""
    if step <= total_steps:
        return
    length = (f"max_steps={cfg.train.max_steps}" if cfg.train.max_steps is not None
              else f"{total_steps} steps from n_epoch={cfg.train.n_epoch}")
    raise ValueError(f"--resume: {ckpt} is at step {step}, past this run's end ({length}); to extend the run, "
                     f"resume with --max_steps above {step} (the LR schedule takes the new length)")


def restore_rank_state(loop: Loop, ckpt: Path, saved_world_size: int) -> None:
    """Each rank's own state (``loop.rank_state()``, optional: online RL's rollout and RNG) from its
    own file. Under another number of ranks than the checkpoint's it cannot be split or merged:
    none is restored (online RL: every rank draws a fresh rollout at the next step), and rank 0
    says so. A rank that cannot read its file fails every rank, so none trains on alone."""
    from astrai.train.checkpoint import load_rank_state
    from astrai.train.publish import CheckpointError

    rank_state = getattr(loop, "rank_state", None)
    if rank_state is None:
        return
    names = list(rank_state())
    if saved_world_size != dist.get_world_size():
        if loop.is_main:
            print(f"warning: {ckpt} holds the per-rank state {names} of {saved_world_size} rank(s) and this run has "
                  f"{dist.get_world_size()}; it is not restored (online RL draws fresh rollouts at the next step)",
                  file=sys.stderr)
        loop.load_rank_state({})
        return
    states: dict[str, Any] = {}
    error: CheckpointError | None = None
    try:
        states = {name: load_rank_state(ckpt, name, dist.get_rank()) for name in names}
    except CheckpointError as e:
        error = e
    if dist.any_rank(error is not None):
        raise error or CheckpointError(f"another rank could not read its own state in {ckpt}; see its log")
    loop.load_rank_state(states)


# ---------------------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states as JSON-able lists."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ---------------------------------------------------------------------------- changed settings

# Fields a resume may change without breaking anything: they are applied from the new config.
APPLIED_ON_RESUME = frozenset({
    "resume", "param_path", "max_steps", "n_epoch", "ckpt_dir", "overwrite_ckpt_dir", "ckpt_interval", "keep_last", "ckpt_background",
    "log_dir", "progress", "summary_hints", "tensorboard", "report_to", "report_project", "run_name", "log_metrics", "trace_samples", "report_html", "val_interval", "val_max_batches", "stop_timeout",
    "early_stopping_metric", "early_stopping_patience", "early_stopping_min_delta", "early_stopping_mode",
    "max_nonfinite_steps", "device", "nprocs", "max_policy_lag", "keep_kv_pool", "host_mmap_threshold_mb", "host_keep_heap",
    # where the rollout servers are and how to reach them (a restarted fleet has new ports)
    "rollout_servers", "rollout_admin_key", "rollout_weights_dir", "rollout_timeout", "rollout_retries",
    "rollout_replicas",
    "async_rollout_source",  # where the same rollouts are drawn (thread or process): the same tokens
})


def report_mismatches(state: dict[str, Any], cfg: Config, world_size: int, total_steps: int) -> None:
    """Settings that differ from the checkpoint's run: say so, never silently. Model fields come
    from the checkpoint (``check_model``); every other new value is applied, and those outside APPLIED_ON_RESUME
    (sample order, batch shape, optimizer, objective) mean the run is no longer exact."""
    saved_cfg = state.get("config", {})
    saved = {k: v for name, section in saved_cfg.items() if name != "model" and isinstance(section, dict)
             for k, v in section.items()}
    now = {k: v for name, section in cfg.to_dict().items() if name != "model" for k, v in section.items()}
    changed = [(k, saved[k], v) for k, v in now.items() if k in saved and saved[k] != v and k not in APPLIED_ON_RESUME]
    changed += [(name, old, new) for name, old, new in (("world_size", state.get("world_size"), world_size),
                                                      ("total_steps", state.get("total_steps"), total_steps))
                if old is not None and old != new]  # total_steps: the LR schedule's length
    for name, old, new in changed:
        print(f"warning: resuming with {name}={new!r} but the checkpoint was trained with {name}={old!r}; the new "
              "value is used, and the run will not match an uninterrupted run exactly", file=sys.stderr)
