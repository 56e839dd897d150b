#!/usr/bin/env bash
# The train service's command: resume from the newest complete checkpoint, else start from the
# base model, and exec the trainer so that the SIGTERM of `docker stop` reaches it (it then
# publishes a checkpoint of the last completed step and exits 0).
#
# Reads <checkpoint mount>/job/ as written by `python -m astrai.ops prepare` (trainer.yaml, args)
# and the ASTRAI_* variables that compose passes in.
set -euo pipefail

ckpt_dir="${ASTRAI_CKPT_MOUNT:-/checkpoints}"
model_dir="${ASTRAI_MODEL_MOUNT:-/model}"
config="$ckpt_dir/job/trainer.yaml"

say() { echo "astrai-entrypoint: $*" >&2; }

if [[ ! -f $config ]]; then
  say "$config is missing; start jobs with scripts/train.sh start (it writes the job/ directory)"
  exit 2
fi

# one rank per visible GPU (CUDA_VISIBLE_DEVICES already filters them), one rank on a CPU; local
# rollout replicas (rl.rollout_replicas) take the first GPUs and the trainer's ranks the rest
gpus="${ASTRAI_GPU_COUNT:-all}"
if [[ $gpus == all ]]; then
  gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
fi
gpus=$((gpus - ${ASTRAI_ROLLOUT_REPLICAS:-0}))
nprocs=$((gpus > 0 ? gpus : 1))
mode="${ASTRAI_PARALLEL_MODE:-auto}"
if [[ $mode == auto ]]; then
  if ((nprocs > 1)); then mode=ddp; else mode=none; fi
fi

cmd=(astrai train --config "$config" --nprocs "$nprocs" --parallel_mode "$mode"
     --stop_timeout "${ASTRAI_STOP_TIMEOUT:-600}")
if [[ -f $model_dir/config.json ]]; then
  cmd+=(--param_path "$model_dir")  # the base model; on resume it only rebuilds the initial policy
fi

# the same selection `--resume` makes: newest complete checkpoint, newer damaged ones skipped
reason="$(mktemp)"
if latest="$(astrai ckpt latest "$ckpt_dir" 2>"$reason")"; then
  cat "$reason" >&2  # warnings about skipped damaged checkpoints
  say "resuming from $latest"
  cmd+=(--resume)
elif compgen -G "$ckpt_dir/step_*" >/dev/null; then
  cat "$reason" >&2
  say "checkpoints exist in $ckpt_dir but none is complete; refusing to start over (inspect with astrai ckpt list $ckpt_dir)"
  rm -f "$reason"
  exit 1
elif [[ -f $model_dir/config.json ]]; then
  say "no checkpoint yet; starting from the base model $model_dir"
else
  say "no checkpoint yet; starting a new model from the model: section"
fi
rm -f "$reason"

extra=()
if [[ -f $ckpt_dir/job/args ]]; then
  mapfile -t extra <"$ckpt_dir/job/args"
fi
cmd+=(${extra[@]+"${extra[@]}"})

if [[ -n ${ASTRAI_MAX_DURATION_SECONDS:-} ]]; then
  # timeout forwards the SIGTERM of `docker stop` and sends its own at the limit; the trainer's
  # exit status is kept, so a graceful stop at the limit exits 0
  cmd=(timeout --preserve-status --signal TERM --kill-after "${ASTRAI_STOP_TIMEOUT:-600}"
       "$ASTRAI_MAX_DURATION_SECONDS" "${cmd[@]}")
fi
say "exec ${cmd[*]}"
exec "${cmd[@]}"
