#!/usr/bin/env bash
# The OpenAI-compatible server in a container (compose service server, or server-cpu).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'USAGE'
usage: scripts/serve.sh [--model DIR] [--port 8000] [--cpu | --rollout [--weights_dir DIR]] build|up|down|logs|status

build    build astrai:latest (the only command that builds)
up       start the server in the background on the model directory DIR (read-only);
         GPU service by default, --cpu for the server-cpu profile, --rollout for a rollout server
         of a trainer on another node (docker/compose.rollout.yaml: the host's network, the admin
         route on with ASTRAI_ADMIN_KEY, weights loaded only from --weights_dir DIR; one compose
         project per --port, so a node runs one per GPU)
down     stop (SIGTERM: the server drains in-flight requests) and remove it
logs     follow its logs          status   show its container
Variables: ASTRAI_SERVE_MODEL_DIR (--model), ASTRAI_PORT (--port), ASTRAI_API_KEY (passed in),
ASTRAI_ADMIN_KEY and ASTRAI_ROLLOUT_WEIGHTS_DIR (--weights_dir) for --rollout,
CUDA_VISIBLE_DEVICES (passed in when set and not empty); .env.serve in the current directory
is read first.
USAGE
}

source_env_file "${ASTRAI_SERVE_ENV_FILE:-.env.serve}"
service=server
files=(-f "$COMPOSE_FILE")
while [[ $# -gt 0 ]]; do
  case $1 in
    --model) ASTRAI_SERVE_MODEL_DIR=${2:?--model needs a directory}; shift 2 ;;
    --port) ASTRAI_PORT=${2:?--port needs a number}; shift 2 ;;
    --cpu) service=server-cpu; shift ;;
    --rollout) service=rollout-server; files+=(-f "$ROLLOUT_COMPOSE_FILE"); shift ;;
    --weights_dir) ASTRAI_ROLLOUT_WEIGHTS_DIR=${2:?--weights_dir needs a directory}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "serve.sh: unknown option $1" >&2; usage >&2; exit 1 ;;
    *) break ;;
  esac
done
[[ $# -eq 1 ]] || { usage >&2; exit 1; }

strip_empty_cuda
export_host_ids
export ASTRAI_PORT="${ASTRAI_PORT:-8000}"
compose() {
  require_compose
  local project=astrai-serve
  [[ $service == rollout-server ]] && project="astrai-rollout-$ASTRAI_PORT"  # one per port: several per node
  docker compose "${files[@]}" -p "$project" --profile "$service" "$@"
}

case $1 in
  build) exec "$ROOT/scripts/docker.sh" build ;;
  up)
    [[ -n ${ASTRAI_SERVE_MODEL_DIR:-} ]] || die "no model: pass --model DIR or set ASTRAI_SERVE_MODEL_DIR"
    [[ -f $ASTRAI_SERVE_MODEL_DIR/config.json ]] || die "$ASTRAI_SERVE_MODEL_DIR holds no config.json (not a model directory)"
    ASTRAI_SERVE_MODEL_DIR="$(cd "$ASTRAI_SERVE_MODEL_DIR" && pwd)"
    export ASTRAI_SERVE_MODEL_DIR
    if [[ $service == rollout-server ]]; then
      [[ -n ${ASTRAI_ADMIN_KEY:-} ]] || die "--rollout: set ASTRAI_ADMIN_KEY (the trainer's rollout_admin_key) so the trainer can load its weights"
      [[ -d ${ASTRAI_ROLLOUT_WEIGHTS_DIR:-} ]] || die "--rollout: --weights_dir DIR (or ASTRAI_ROLLOUT_WEIGHTS_DIR) must be an existing directory: the only one weights load from"
      ASTRAI_ROLLOUT_WEIGHTS_DIR="$(cd "$ASTRAI_ROLLOUT_WEIGHTS_DIR" && pwd)"
      export ASTRAI_ADMIN_KEY ASTRAI_ROLLOUT_WEIGHTS_DIR
    fi
    compose up --detach --no-build "$service"
    echo "serving on port $ASTRAI_PORT; wait for: curl -s localhost:$ASTRAI_PORT/health"
    ;;
  down) compose down --timeout 60 ;;
  logs) compose logs --follow --tail 200 "$service" ;;
  status) compose ps --all "$service" ;;
  *) echo "serve.sh: unknown command $1" >&2; usage >&2; exit 1 ;;
esac
