"""Strict, typed run configuration: YAML sections + ``--flag`` overrides -> one ``Config``.

Sits at the very start of the data flow: ``astrai train --config run.yaml --max_lr 3e-4`` is
turned into a ``Config`` here, and every other module reads its numbers from that object. Each
tunable number has one name, one default and one place (a dataclass field). Names form one flat
namespace of unique snake_case keys; the YAML sections (model, data, train, optim, objective,
lora, ckpt, log, dist) only group them for reading, so on the command line the section is optional.
Precedence is flag > YAML > default. Unknown keys and flags are errors with a did-you-mean,
and a value of the wrong type names the field, the value and the expected type. A field whose
numbers have a range is a ``knob`` (astrai.flags): the range is its metadata, which
``config_checks.validate`` checks and the docs test compares with the docs' rows.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from astrai.config_values import (
    ConfigError,
    base_types,
    check_value,
    did_you_mean,
    parse_flag_value,
    type_name,
)
from astrai.flags import knob


@dataclass
class DataConfig:
    train_type: str = "sft"  # seq | sft | dpo | grpo (recorded samples) | online_grpo | online_dpo | online_ppo | online_distill | kd | reward
    data_path: str | None = None  # JSONL file, preprocessed shard dir, or a dataset: hf:NAME[@SPLIT] or a save_to_disk dir
    data_columns: dict[str, str] | None = None  # record field -> column of the rows (datasets and JSONL)
    tokenizer_path: str | None = None  # defaults to param_path
    max_seq_len: int = knob(128, ge=1)
    pack: bool = False  # pack several documents per row (seq and sft), positions reset per document
    group_by_length: bool = False  # batch samples of similar length (less padding); still seeded and resumable
    seq_stride: int | None = knob(None, ge=1)  # sliding-window stride for long seq documents
    val_data_path: str | None = None
    val_split: float = knob(0.0, ge=0, lt=1)  # fraction of data_path held out for validation when no val_data_path
    eval_data_path: str | None = None  # held-out prompt records with answers, scored by generation (eval_interval)


@dataclass
class TrainSection:
    param_path: str | None = None  # weights-only init (model dir or checkpoint dir)
    resume: bool = False  # restore the full training state
    n_epoch: int = knob(1, ge=1)
    max_steps: int | None = knob(None, ge=1)  # optimizer steps (overrides n_epoch); None = n_epoch over the data
    batch_per_device: int = knob(4, ge=1)
    grad_accum_steps: int = knob(1, ge=1)
    max_grad_norm: float = knob(1.0, ge=0)  # 0 disables clipping (the norm is still measured)
    random_seed: int = 0
    device: str | None = None  # default: cuda when available, else cpu
    bf16: bool = False  # bf16 autocast for forward/backward
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile the model
    cpu_matmul: str = "auto"  # auto | onednn | blas: float32 CPU matrix products (process-wide); auto: oneDNN when built in
    stop_timeout: float = 600.0  # seconds the launcher waits for ranks after a stop signal
    val_interval: int = knob(0, ge=0)  # optimizer steps between validations; 0 = only at the end when val data exists
    val_max_batches: int | None = knob(None, ge=1)
    eval_interval: int = knob(0, ge=0)  # optimizer steps between generation evals on eval_data_path (and at 0 and the end); 0 = off
    eval_num_samples: int = knob(4, ge=0)  # sampled completions per eval prompt (rollout temperature) for eval/reward_mean; 0 = greedy only
    eval_pass_k: list[int] = field(default_factory=list)  # pass@k of the sampled eval answers for each k (<= eval_num_samples), unbiased; [] = none
    eval_match: str = "exact"  # exact | final_number: how eval/accuracy scores a greedy completion against the answer
    early_stopping_metric: str | None = None  # e.g. val/loss; None disables early stopping
    early_stopping_patience: int = 3  # evaluations without improvement before stopping
    early_stopping_min_delta: float = 0.0
    early_stopping_mode: str = "min"  # min | max
    max_nonfinite_steps: int = knob(10, ge=1)  # consecutive skipped (non-finite loss or grad norm) steps before the run stops


@dataclass
class OptimConfig:
    optimizer: str = "adamw"  # adamw | muon (Muon for 2-D hidden matrices, AdamW for the rest)
    max_lr: float | None = knob(None, ge=0)  # null: 1e-3 from scratch; fine-tuning (param_path): 2e-5 seq/sft, 1e-6 dpo/RL
    weight_decay: float = knob(0.0, ge=0)
    decay_all_params: bool = False  # default: decay only 2-D weight matrices
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    muon_momentum: float = 0.95
    schedule: str = "cosine"  # constant | cosine | wsd
    warmup_ratio: float | None = knob(None, ge=0, le=1)  # fraction of total optimizer steps; null: 0 from scratch, 0.03 fine-tuning
    warmup_steps: int | None = knob(None, ge=0)  # overrides warmup_ratio when set
    min_lr_ratio: float = knob(0.0, ge=0, le=1)  # final lr = max_lr * min_lr_ratio (cosine, wsd)
    decay_ratio: float = knob(0.2, ge=0, le=1)  # wsd: fraction of steps in the final decay


@dataclass
class ObjectiveConfig:
    label_smoothing: float = knob(0.0, ge=0, le=1)  # cross-entropy label smoothing (seq, sft)
    row_layout: str = "flat"  # seq, sft, dpo, reward, kd: flat (one padding-free row) | pack (padding-free bins) | share (pack, and a prefix common to consecutive rows computed once) | pad (rows padded to the longest)
    beta: float = knob(0.1, ge=0)  # DPO temperature
    dpo_label_noise: float = knob(0.0, ge=0, lt=0.5)  # DPO sigmoid loss: assumed share of flipped preference labels (cDPO), < 0.5
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    ref_model_path: str | None = None  # DPO reference; default: a frozen copy of the initial policy
    reference_free: bool = False
    center_rewards_coefficient: float = knob(0.0, ge=0)  # reward: weight of (r_chosen + r_rejected)^2, keeping scores near 0 (TRL)
    teacher_path: str | None = None  # online_distill, kd: the teacher model directory (the policy's tokenizer)
    teacher_url: str | None = None  # online_distill: an OpenAI-compatible server returning prompt log-probs (echo + logprobs)
    teacher_api_key_env: str | None = None  # teacher_url: the environment variable holding the server's API key
    distill_loss: str = "reverse_kl_pg"  # online_distill: reverse_kl_pg (per-token advantage log teacher - log student) | jsd
    distill_beta: float = knob(0.5, ge=0, le=1)  # jsd (online_distill) and kd: 0 forward KL, 1 reverse KL (TRL GKD's beta)
    distill_coef: float = knob(0.0, ge=0)  # online_distill: weight of the task reward's advantage beside the teacher's


@dataclass
class RLConfig:
    group_size: int = knob(4, ge=1)  # samples per prompt (GRPO group; online DPO picks best and worst of them)
    rollout_interval: int = knob(1, ge=1)  # optimizer steps that reuse one rollout before it is regenerated
    mini_batches: int = knob(1, ge=1)  # optimizer steps per pass over a fresh rollout, each on 1/mini_batches of its samples
    ppo_epochs: int = knob(1, ge=1)  # passes over a rollout of mini_batches steps each
    rollout_max_tokens: int = knob(64, ge=1)  # new tokens per sample
    rollout_temperature: float = knob(1.0, ge=0)  # the trainer's log-probs use the same temperature
    rollout_top_p: float = knob(1.0, gt=0, le=1)
    rollout_top_k: int = knob(0, ge=-1)  # 0 = off
    rollout_repetition_penalty: float = knob(1.0, gt=0, le=10)  # rollouts: logits of prompt and output tokens divided (positive) or multiplied by it; 1 = off
    rollout_min_p: float = knob(0.0, ge=0, lt=1)  # min-p sampling in rollouts (0 = off); the trainer's log-probs truncate the same way
    max_prompt_len: int | None = knob(None, ge=1)  # None = 256 or what fits the model's positions; longer prompts are skipped
    max_policy_lag: int = knob(8, ge=0)  # a rollout more policy versions old than this is an error
    async_steps: int = knob(0, ge=0)  # 0 = synchronous; k: the rollout of step t is drawn by the policy after step t - k, on a thread beside training
    async_rollout_source: str = "auto"  # auto | thread | process: where async_steps' engine runs (the rollout thread, or a spawned process beside it); auto: process on CPU, thread otherwise
    keep_kv_pool: bool = False  # the engine's KV pool stays allocated through training; false: made per rollout, freed after
    host_mmap_threshold_mb: int = knob(0, ge=0, le=32, note="(MiB; glibc accepts at most 32); use 1, or 0 to keep the C allocator's default")  # glibc: host tensors this large (MiB) get their own mapping (no heap fragmentation); 0 = glibc's default
    host_keep_heap: bool = True  # glibc: while the engine decodes, freed heap memory stays mapped (no trim, no page faults back)
    rollout_is_level: str = "token"  # none | token | sequence: truncated importance weights for sampler-trainer mismatch
    rollout_is_cap: float = knob(2.0, ge=1, note="(a weight of 1 is no correction)")  # the weight min(pi_trainer_old / pi_sampler, cap) is capped here
    rollout_is_mode: str = "truncate"  # truncate: min(w, cap) | mask: w within [rollout_is_min, rollout_is_cap], else the token carries no loss (TRL's)
    rollout_is_min: float | None = knob(None, ge=0, le=1)  # rollout_is_mode mask: the band's lower bound; None = 1 / rollout_is_cap
    clip_eps: float = knob(0.2, ge=0)  # PPO clip of the token ratio, below 1
    clip_eps_high: float | None = knob(None, ge=0)  # above 1 (DAPO); None = clip_eps
    policy_loss: str = "clip"  # clip: PPO's clipped surrogate | cispo: REINFORCE weighted by the clipped, stop-gradient ratio (MiniMax-M1)
    clip_ratio_c: float | None = knob(None, gt=1)  # dual-clip PPO: with A < 0 the loss is at most -clip_ratio_c * A; None = off (verl: 3)
    entropy_coef: float = knob(0.0, ge=0)  # GRPO family and online_ppo: loss - entropy_coef * the policy's token entropy (a bonus)
    kl_coef: float = knob(0.0, ge=0)  # KL to the reference (kl_estimator); 0 loads no reference model
    ref_reset_interval: int = knob(0, ge=0)  # with a KL: every this many steps the reference becomes the current policy; 0 = never
    ref_ema: float | None = knob(None, ge=0, lt=1)  # with a KL: after each step reference = ref_ema * reference + (1 - ref_ema) * policy; None = frozen
    kl_estimator: str = "k3+"  # k1: log(p/q) | k2: (log(p/q))^2 / 2 | k3: q/p - 1 - log(q/p) | k1+, k3+: k1's, k3's value with k2's gradient
    kl_in_reward: bool = False  # GRPO family: the KL goes into each sample's reward (score - kl_coef * sum of KL), not the loss
    advantage_estimator: str = "grpo"  # grpo | rloo (leave-one-out) | reinforce_pp (REINFORCE++)
    importance_sampling_level: str = "token"  # token | sequence (GSPO: one ratio per sample) | sequence_token (GSPO-token)
    mask_truncated_completions: bool = False  # completions cut at rollout_max_tokens carry no loss
    dynamic_sampling: bool = False  # DAPO: drop groups with equal rewards, draw more prompts to refill
    max_resample_batches: int = knob(4, ge=0)  # dynamic_sampling: extra prompt batches drawn per rollout at most
    scale_rewards: str = "group"  # group: (r - mean) / (max(std, reward_std_floor) + 1e-8) per group | none: r - mean (Dr. GRPO)
    reward_std_floor: float = knob(1e-4, ge=0)  # scale_rewards group: a group's std counts as at least this, so near-equal rewards get small advantages
    rl_loss_agg: str = "token_mean"  # token_mean | seq_mean | seq_mean_token_sum_norm
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])  # exact_match | final_number | format | length | overlong | judge | module:function | a reward model dir
    reward_weights: list[float] | None = None  # one per reward; None = all 1.0
    reward_timeout: float = knob(60.0, ge=0)  # seconds one user reward call (or judge / teacher request) may take; 0 = no limit
    tool_timeout: float = knob(60.0, ge=0)  # multi-turn: seconds one tool call may take (past it: an error message to the model); 0 = no limit
    env_timeout: float = knob(600.0, ge=0)  # multi-turn: seconds one environment call (constructor, reset, step) may take (past it: the run stops); 0 = no limit
    judge_url: str | None = None  # the judge reward: an OpenAI-compatible server (chat completions)
    judge_model: str | None = None  # the judge's model name; None = the server's first model
    judge_prompt: str | None = None  # the judge's request, with {prompt}, {completion}, {answer}; None = a 0-10 rating prompt
    judge_api_key_env: str | None = None  # the environment variable holding the judge's API key
    judge_concurrency: int = knob(8, ge=1)  # judge requests in flight at a time
    environment: str | None = None  # multi-turn: module:Class, one instance per sample (reset / step)
    tools: list[str] = field(default_factory=list)  # multi-turn: module:function tools offered to the model
    routing_replay: bool = False  # MoE policies: the trainer's forward on rollout rows uses the experts the rollout engine routed each token to
    turn_rewards: bool = False  # multi-turn, online_ppo / reinforce_pp: each environment step's reward on its turn's last sampled token, not summed at the end
    max_turns: int = knob(4, ge=1, note="(assistant turns per multi-turn episode)")  # multi-turn: assistant turns per episode; an episode that would go on is truncated
    format_pattern: str = r"^\s*-?\d+\s*$"  # the `format` reward: 1 when the completion matches
    length_target: int = 64  # the `length` reward: 0 up to this many characters, then down to -1 at twice
    overlong_buffer: int = 16  # the `overlong` reward (DAPO): 0 to -1 over the last this many of rollout_max_tokens
    ppo_gamma: float = knob(1.0, ge=0, le=1)  # online_ppo: GAE discount
    ppo_gae_lambda: float = knob(0.95, ge=0, le=1)  # online_ppo: GAE lambda
    ppo_vf_coef: float = knob(0.5, ge=0)  # online_ppo: weight of the critic's (V - R)^2
    critic_lr: float | None = knob(None, gt=0)  # online_ppo: the critic's peak lr; None = max_lr
    critic_model_path: str | None = None  # online_ppo: the critic's start; None = the policy's trunk, zero head
    value_clip: float | None = knob(None, gt=0)  # online_ppo: clip V - V_old to +-value_clip; None = unclipped
    whiten_advantages: bool = False  # online_ppo: whiten advantages over each rollout
    rollout_servers: list[str] = field(default_factory=list)  # `astrai serve` URLs that draw the rollouts; [] = the in-process engine
    rollout_admin_key: str | None = None  # the servers' --admin_key (weight loads); None = $ASTRAI_ADMIN_KEY
    rollout_weights_dir: str | None = None  # where rank 0 publishes each policy version for the servers (under their --weights_dir); None = <log_dir>/rollout_weights
    rollout_timeout: float = knob(600.0, gt=0)  # seconds one HTTP call to a rollout server may take
    rollout_retries: int = knob(2, ge=0)  # retries of a failed call (connection error, 5xx) before the run stops
    rollout_weight_transport: str = "filesystem"  # filesystem (publish + /v1/load_weights by path) | broadcast (a gloo group with the servers; NCCL when all are on CUDA)
    rollout_replicas: int = knob(0, ge=0)  # `astrai train` starts this many local `astrai serve` replicas and draws from them; 0 = none


@dataclass
class LoraConfig:
    lora_r: int = knob(0, ge=0)  # adapter rank; 0 = off (full fine-tuning)
    lora_alpha: float = knob(16.0, gt=0)  # the update is scaled by lora_alpha / lora_r
    lora_dropout: float = knob(0.0, ge=0, lt=1)  # dropout on the adapter's input
    lora_targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])


@dataclass
class CkptConfig:
    ckpt_dir: str = "out/ckpt"
    overwrite_ckpt_dir: bool = False  # a fresh run (no resume) may delete the checkpoints already in ckpt_dir
    ckpt_interval: int = knob(100, ge=0)  # optimizer steps; 0 = only at stop/end
    keep_last: int | None = knob(3, ge=1)
    ckpt_background: bool = True  # hash, fsync and rename on a thread; the loop only waits for the writes


@dataclass
class LogConfig:
    log_dir: str = "out"  # metrics.jsonl, plots
    progress: bool = True  # tqdm bar on rank 0
    summary_hints: bool = True  # the run summary's "serve it" and "resume" lines (the demo's stages turn them off)
    tensorboard: bool = False  # the same as report_to: [tensorboard] (needs the tensorboard package)
    report_to: list[str] = field(default_factory=list)  # tensorboard | wandb | mlflow: the metrics.jsonl numbers
    report_project: str | None = None  # wandb project / mlflow experiment; None = $WANDB_PROJECT / $MLFLOW_EXPERIMENT_NAME, else astrai
    run_name: str | None = None  # wandb / mlflow run name; None = the log_dir's folder name
    log_metrics: list[str] | None = None  # objective metrics to log; None = all, [] = none
    trace_samples: int = knob(8, ge=0)  # samples per fresh rollout (and per eval draw) written to traces.jsonl; 0 = none
    report_html: bool = False  # refresh <log_dir>/report.html (astrai report) at each checkpoint and at the end


@dataclass
class DistConfig:
    nprocs: int = knob(1, ge=1)
    parallel_mode: str = "none"  # none | ddp | fsdp


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "train": TrainSection,
    "optim": OptimConfig,
    "objective": ObjectiveConfig,
    "rl": RLConfig,
    "lora": LoraConfig,
    "ckpt": CkptConfig,
    "log": LogConfig,
    "dist": DistConfig,
}


@dataclass
class Config:
    """The resolved run configuration. ``model`` holds ModelConfig fields (HF names) or is empty."""

    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # situation-dependent defaults filled at load time: field -> why (reported in a run's first lines)
    filled_defaults: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sectioned plain dict (YAML/JSON-able), the form written to trainer_state.json."""
        out: dict[str, dict[str, Any]] = {"model": dict(self.model)}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """One flat dict of every key (the flat namespace)."""
        return {k: v for section in self.to_dict().values() for k, v in section.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from a sectioned (or flat) dict with full checking; used by YAML and resume."""
        return build_config(data, {})


# ---------------------------------------------------------------- field tables and type checks


def model_field_types() -> dict[str, Any]:
    """ModelConfig field names -> types."""
    from astrai.model.config import ModelConfig

    hints = typing.get_type_hints(ModelConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ModelConfig) if not f.name.startswith("_")}


def field_table() -> dict[str, tuple[str, Any]]:
    """Flat key -> (section, type). Raises if two sections would claim the same name."""
    table: dict[str, tuple[str, Any]] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            table[f.name] = (section, hints[f.name])
    for name, tp in model_field_types().items():
        if name in table:
            raise ConfigError(
                f"config key {name!r} is both a ModelConfig field and a {table[name][0]!r} field; "
                "flat names must be unique"
            )
        table[name] = ("model", tp)
    return table


# ----------------------------------------------------------------------------- assembling


def build_config(yaml_data: dict[str, Any], overrides: dict[str, Any]) -> Config:
    """Merge YAML (sectioned or flat) with already-typed flag overrides and validate."""
    table = field_table()
    values: dict[str, Any] = {}  # flat key -> value, YAML first, flags on top
    if not isinstance(yaml_data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(yaml_data).__name__}")
    for key, content in yaml_data.items():
        if key == "model" or key in SECTIONS:
            if content is None:
                continue
            if not isinstance(content, dict):
                raise ConfigError(f"section {key!r} must be a mapping, got {content!r}")
            for name, value in content.items():
                values[name] = _check_key(name, key, value, table)
        elif key in table and not (isinstance(content, dict) and not _takes_mapping(table[key][1])):
            values[key] = check_value(key, table[key][0], content, table[key][1])  # flat key at top level
        elif isinstance(content, dict):  # a mapping: meant as a section
            raise ConfigError(_unknown_section(key, content, table))
        else:
            names = ["model", *SECTIONS, *table]
            raise ConfigError(f"unknown config section or key {key!r}{did_you_mean(key, names)}")
    values.update(overrides)
    return _assemble(values, table)


# peak learning rates when fine-tuning a trained model (param_path set), as TRL's trainers default
FINE_TUNING_LR = {"seq": 2e-5, "sft": 2e-5, "kd": 2e-5, "reward": 1e-4}
FINE_TUNING_LR_OTHER = 1e-6  # preference and RL objectives
FROM_SCRATCH_LR = 1e-3
FINE_TUNING_WARMUP_RATIO = 0.03


def resolve_defaults(cfg: Config) -> None:
    """Fill the situation-dependent defaults (max_lr, warmup_ratio) and remember which were filled,
    so the run can say so in its first lines."""
    o, fine_tuning = cfg.optim, cfg.train.param_path is not None
    situation = f"fine-tuning {cfg.data.train_type}" if fine_tuning else "training from scratch"
    if o.max_lr is None:
        o.max_lr = FINE_TUNING_LR.get(cfg.data.train_type, FINE_TUNING_LR_OTHER) if fine_tuning else FROM_SCRATCH_LR
        cfg.filled_defaults["max_lr"] = situation
    if o.warmup_ratio is None:
        o.warmup_ratio = FINE_TUNING_WARMUP_RATIO if fine_tuning and o.warmup_steps is None else 0.0
        if o.warmup_steps is None:  # otherwise warmup_steps decides and the ratio is unused
            cfg.filled_defaults["warmup_ratio"] = situation


def _takes_mapping(tp: Any) -> bool:
    """A field whose value may be a mapping (rope_scaling, data_columns): `optimizer: {...}` is not one."""
    return any((typing.get_origin(b) or b) is dict for b in base_types(tp))


def _unknown_section(key: str, content: dict[str, Any], table: dict[str, tuple[str, Any]]) -> str:
    """`unknown config section 'optimiser'; did you mean 'optim'?`: the closest section name, else
    the section that owns the keys inside it."""
    sections = ["model", *SECTIONS]
    hint = did_you_mean(key, sections)
    if not hint:
        owners = {table[name][0] for name in content if name in table}
        hint = f"; did you mean '{owners.pop()}' (the section of {', '.join(map(str, content))})?" \
            if len(owners) == 1 else ""
    if not hint and did_you_mean(key, list(table)):  # a mapping-valued key (rope_scaling) misspelled
        return f"unknown config section or key {key!r}{did_you_mean(key, list(table))}"
    return f"unknown config section {key!r}{hint} (sections: {', '.join(sections)})"


def _check_key(name: str, section: str, value: Any, table: dict[str, tuple[str, Any]]) -> Any:
    if name not in table:
        in_section = [k for k, (s, _) in table.items() if s == section]
        raise ConfigError(f"unknown config key {name!r} in section {section!r}{did_you_mean(name, in_section)}")
    owner, tp = table[name]
    if owner != section:
        raise ConfigError(f"config key {name!r} belongs to section {owner!r}, not {section!r}; move it there")
    return check_value(name, section, value, tp)


def _assemble(values: dict[str, Any], table: dict[str, tuple[str, Any]]) -> Config:
    per_section: dict[str, dict[str, Any]] = {s: {} for s in ["model", *SECTIONS]}
    for name, value in values.items():
        section = table[name][0] if name in table else "model"
        per_section[section][name] = value
    cfg = Config(model=per_section.pop("model"), **{s: SECTIONS[s](**kw) for s, kw in per_section.items()})
    resolve_defaults(cfg)
    from astrai.config_checks import validate

    validate(cfg)
    return cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file; a missing file or a syntax error is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; check --config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` / bare ``--bool_key`` / ``--no-bool-key`` -> typed flat overrides.
    Keys are accepted in snake_case (as in the YAML) and kebab-case (``--max-lr``, vLLM's)."""
    table = field_table()
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; config values are given as --key value")
        name, eq, text = arg[2:].partition("=")
        name = name.replace("-", "_")  # --max-lr (vLLM's kebab-case) is --max_lr
        if "." in name:  # allow --optim.max_lr
            name = name.split(".", 1)[1]
        negated = name.removeprefix("no_")
        if name not in table and negated != name and negated in table:  # --no-pack: a boolean set false
            if bool not in base_types(table[negated][1]):
                raise ConfigError(f"flag {arg} sets {negated!r} false, but {negated!r} is "
                                  f"{type_name(table[negated][1])}, not a boolean; give --{negated} VALUE")
            if eq:
                raise ConfigError(f"flag {arg} takes no value; use --{negated} {text} instead")
            out[negated] = False
            i += 1
            continue
        if name not in table:
            raise ConfigError(f"unknown flag --{name}{did_you_mean(name, list(table))}")
        section, tp = table[name]
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if bool in base_types(tp) and (nxt is None or nxt.startswith("--")):
                out[name] = True
                i += 1
                continue
            if nxt is None:
                raise ConfigError(f"flag --{name} needs a value ({type_name(tp)})")
            text = nxt
            i += 1
        out[name] = parse_flag_value(name, section, text, tp)
        i += 1
    return out


def load_config(config_path: str | Path | None, args: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- flags. The one entry point the CLI uses."""
    data = load_yaml(config_path) if config_path is not None else {}
    return build_config(data, parse_overrides(list(args or [])))
