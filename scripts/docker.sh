#!/usr/bin/env bash
# Build the astrai image, or run one command in it.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# The one command that builds the image; nothing else builds.
build_image() {
  export_host_ids
  docker build -f "$ROOT/docker/Dockerfile" -t "$IMAGE" \
    --build-arg "USER_UID=$ASTRAI_UID" --build-arg "USER_GID=$ASTRAI_GID" \
    --build-arg "TORCH_VARIANT=${ASTRAI_TORCH_VARIANT:-cu128}" "$@" "$ROOT"
}

usage() {
  cat <<'USAGE'
usage: scripts/docker.sh build [-- DOCKER_BUILD_OPTIONS]
       scripts/docker.sh run [--gpu | --no-gpu] [--port 8000] [-- COMMAND ...]

build   build astrai:latest (ASTRAI_TORCH_VARIANT=cpu|cu128|... picks the torch wheels;
        the image's user gets your uid/gid)
run     run COMMAND (default: astrai --help) in astrai:latest with the current directory at
        /workspace; every GPU by default (CUDA_VISIBLE_DEVICES, when set, filters them);
        --port publishes that port (e.g. for astrai serve --host 0.0.0.0 --port 8000)
USAGE
}

[[ $# -ge 1 ]] || { usage >&2; exit 1; }
command=$1
shift
case $command in
  build)
    [[ ${1:-} == -- ]] && shift
    build_image "$@"
    ;;
  run)
    gpu=1
    port=""
    while [[ $# -gt 0 ]]; do
      case $1 in
        --gpu) gpu=1; shift ;;
        --no-gpu) gpu=0; shift ;;
        --port)
          [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "docker.sh: --port needs a number" >&2; usage >&2; exit 1; }
          port=$2; shift 2 ;;
        --) shift; break ;;
        -h | --help) usage; exit 0 ;;
        *) echo "docker.sh: unknown option $1" >&2; usage >&2; exit 1 ;;
      esac
    done
    strip_empty_cuda
    export_host_ids
    args=(run --rm --init --ipc host --user "$ASTRAI_UID:$ASTRAI_GID"
          --volume "$PWD:/workspace" --workdir /workspace)
    if [[ -t 0 && -t 1 ]]; then args+=(--interactive --tty); fi
    if ((gpu)); then
      args+=(--gpus all)
      if [[ -v CUDA_VISIBLE_DEVICES ]]; then args+=(--env "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"); fi
    fi
    if [[ -n $port ]]; then args+=(--publish "$port:$port"); fi
    exec docker "${args[@]}" "$IMAGE" "$@"
    ;;
  -h | --help) usage ;;
  *) echo "docker.sh: unknown command $command" >&2; usage >&2; exit 1 ;;
esac
