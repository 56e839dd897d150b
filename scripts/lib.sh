# shellcheck shell=bash
# Shared by scripts/train.sh, serve.sh and docker.sh (sourced, never run).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# used by the scripts that source this file
# shellcheck disable=SC2034
COMPOSE_FILE="$ROOT/docker/compose.yaml"
# shellcheck disable=SC2034
ROLLOUT_COMPOSE_FILE="$ROOT/docker/compose.rollout.yaml"
# shellcheck disable=SC2034
IMAGE="astrai:latest"
# the Python that has this project (and PyYAML); the project's .venv when it exists
if [[ -z ${ASTRAI_PYTHON:-} ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then ASTRAI_PYTHON="$ROOT/.venv/bin/python"; else ASTRAI_PYTHON=python3; fi
fi

die() {
  echo "$(basename "$0"): $*" >&2
  exit 1
}

# An empty CUDA_VISIBLE_DEVICES hides every GPU; treat it as unset (= every GPU).
strip_empty_cuda() {
  if [[ -v CUDA_VISIBLE_DEVICES && -z $CUDA_VISIBLE_DEVICES ]]; then
    unset CUDA_VISIBLE_DEVICES
  fi
}

# The host user's ids: containers write mounted directories as this user.
export_host_ids() {
  ASTRAI_UID="$(id -u)"
  ASTRAI_GID="$(id -g)"
  export ASTRAI_UID ASTRAI_GID
}

# Source KEY=value lines into the environment; UID/GID lines are bash's read-only variables
# (kept in some .env files for compose) and are dropped.
source_env_file() {
  local file=$1
  [[ -f $file ]] || return 0
  set -a
  # shellcheck disable=SC1090
  source <(grep -Ev '^[[:space:]]*(export[[:space:]]+)?(UID|GID|EUID|PPID)=' "$file")
  set +a
}

# `docker compose` is a plugin of the docker CLI: without it docker reads `compose -f FILE` as its
# own flags ("unknown shorthand flag: 'f' in -f"). Say so before the first compose command.
require_compose() {
  command -v docker >/dev/null 2>&1 || die "docker: the docker command is not installed"
  docker compose version >/dev/null 2>&1 ||
    die "docker compose: the Compose plugin is missing ('docker compose version' fails); install it (the docker-compose-plugin package, Compose v2) and retry"
}
