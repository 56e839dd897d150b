#!/usr/bin/env bash
# One training job in a container, driven by its YAML file (the trainer's sections + infra:).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'USAGE'
usage: scripts/train.sh [-f train.yaml] COMMAND

init                      write a template train.yaml (never overwrites)
preflight                 check the Docker daemon, data_dir, checkpoint_dir (writable), the base
                          model (when there is no checkpoint yet), the GPUs and the trainer config
build                     build astrai:latest (the only command that builds)
start [--foreground] [-- TRAINER_ARGS]
                          preflight, then run the job in the background (or attached); it resumes
                          from the newest complete checkpoint when there is one
stop                      SIGTERM: the trainer publishes a checkpoint and exits; the engine kills
                          it after infra.stop_timeout_seconds
restart [-- TRAINER_ARGS] stop, then start
logs | status             follow the job's logs | show its container
latest | list             the checkpoint a start would resume from | every checkpoint
clean [--keep N] [--force]
                          remove all but the newest N complete checkpoints (default
                          infra.keep_last); without --force only show what would go
The job file defaults to ./train.yaml; .env.train next to it supplies infra keys it leaves out.
Rollouts from servers (the job's rl: section): rollout_replicas: N runs N local servers on the
job's first N devices; rollout_servers: [URL, ...] uses servers started on another node
(scripts/serve.sh --rollout up), and the container joins the host's network.
USAGE
}

job_file=train.yaml
while [[ $# -gt 0 ]]; do
  case $1 in
    -f | --file) job_file=${2:?-f needs a job file}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "train.sh: unknown option $1" >&2; usage >&2; exit 1 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { usage >&2; exit 1; }
command=$1
shift

ops() { "$ASTRAI_PYTHON" -m astrai.ops "$@"; }

# .env.train first, then the job file's infra: on top (the helper prints export/unset lines)
load_job() {
  [[ -f $job_file ]] || die "job file $job_file not found; create one with: scripts/train.sh -f $job_file init"
  source_env_file "${ASTRAI_ENV_FILE:-$(dirname "$job_file")/.env.train}"
  strip_empty_cuda
  local exports
  exports="$(ops env "$job_file")" || exit 1
  eval "$exports"
  export_host_ids
}

# a job whose rollouts come from servers elsewhere joins the host's network (compose.rollout.yaml)
compose() {
  local files=(-f "$COMPOSE_FILE")
  [[ -n ${ASTRAI_ROLLOUT_SERVERS:-} ]] && files+=(-f "$ROLLOUT_COMPOSE_FILE")
  docker compose "${files[@]}" -p "$ASTRAI_PROJECT" --profile train "$@"
}

start() {
  local foreground=0
  while [[ $# -gt 0 ]]; do
    case $1 in
      --foreground) foreground=1; shift ;;
      --) shift; break ;;
      *) die "start: unknown option $1 (trainer flags go after --)" ;;
    esac
  done
  ops preflight "$job_file" -- "$@"
  ops prepare "$job_file" -- "$@" >/dev/null
  if ((foreground)); then
    compose up --no-build --abort-on-container-exit train
  else
    compose up --detach --no-build train
    echo "started job $ASTRAI_JOB_NAME; follow it with: scripts/train.sh -f $job_file logs"
  fi
}

stop() { compose stop --timeout "$ASTRAI_STOP_TIMEOUT" train; }

case $command in
  init) ops init "$job_file" ;;
  build) exec "$ROOT/scripts/docker.sh" build ;;
  -h | --help | help) usage ;;
  *)
    load_job
    case $command in
      preflight) ops preflight "$job_file" -- "$@" ;;
      start) start "$@" ;;
      stop) stop ;;
      restart)
        [[ ${1:-} == -- ]] && shift
        stop
        start -- "$@"
        ;;
      logs) compose logs --follow --tail 200 train ;;
      status) compose ps --all train ;;
      latest) "$ASTRAI_PYTHON" -m astrai ckpt latest "$ASTRAI_CHECKPOINT_DIR" ;;
      list) "$ASTRAI_PYTHON" -m astrai ckpt list "$ASTRAI_CHECKPOINT_DIR" ;;
      clean) ops clean "$job_file" "$@" ;;
      *) echo "train.sh: unknown command $command" >&2; usage >&2; exit 1 ;;
    esac
    ;;
esac
