"""`astrai serve`: the command line of the HTTP server (flags, checks, uvicorn, signals).

`main(argv)` is what `astrai serve` runs (src/astrai/cli.py's command table points here): it parses
the server's flags plus one flag per `EngineConfig` field, refuses an unusable command line with
one line on stderr (exit 2) before anything loads, builds the app of `app.py` and runs it on
uvicorn; a model that fails to load in the background (an engine that cannot be built) stops the
server with that reason, exit 2. SIGTERM stops accepting connections, lets in-flight requests finish for
`--shutdown_timeout` seconds, aborts the rest (each stream ends with finish_reason "abort") and
exits 0. Connections are bounded too (`uvicorn_config`): one that has not sent a complete
request head within `--header_timeout` seconds of connecting or of its previous response (idle,
or trickling header bytes) is closed, which uvicorn's keep-alive timeout alone does not do, and
beyond `--limit_concurrency` open connections a request gets 503.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from astrai.flags import ArgumentParser, add_dataclass_arguments
from astrai.infer.defaults import GENERATION_CONFIG_HELP, generation_defaults
from astrai.model.manifest import VERIFY_HELP
from astrai.serve.app import create_app
from astrai.serve.header_timeout import header_timeout_protocol
from astrai.serve.state import ServeConfig, ServerState

HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a complete request head
LIMIT_CONCURRENCY = 1024  # open connections served at once; each is a file descriptor (mind ulimit -n)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="astrai serve", description="OpenAI-compatible HTTP server.")
    p.add_argument("--model", required=True, help="model or checkpoint directory (config.json, model.safetensors, "
                   "tokenizer), or a run's ckpt_dir (its newest complete checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", default=os.environ.get("ASTRAI_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ASTRAI_API_KEY)")
    p.add_argument("--admin_key", default=os.environ.get("ASTRAI_ADMIN_KEY"),
                   help="turn on the admin routes (POST /v1/load_weights), which require 'Authorization: Bearer "
                        "KEY'; distinct from --api_key (default: $ASTRAI_ADMIN_KEY; unset: the routes are off)")
    p.add_argument("--weights_dir", default=None,
                   help="/v1/load_weights loads only model directories under this one (a trainer publishes "
                        "its policy versions there)")
    p.add_argument("--served_model_name", default=None, help="model id clients send (default: directory name)")
    p.add_argument("--max_request_bytes", type=int, default=8 * 2**20, help="larger bodies get 413")
    p.add_argument("--max_waiting", type=int, default=None,
                   help="sequences admitted beyond max_num_seqs before new requests get 429 "
                        "(default: 4 x max_num_seqs)")
    p.add_argument("--body_timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; slower bodies get 408")
    p.add_argument("--verify", action="store_true", default=None, help=VERIFY_HELP)
    p.add_argument("--shutdown_timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--header_timeout", type=float, default=HEADER_TIMEOUT,
                   help="seconds a connection may go without a complete request head (after connecting or "
                        f"after a response; idle or trickling) before it is closed (default: {HEADER_TIMEOUT})")
    p.add_argument("--limit_concurrency", type=int, default=LIMIT_CONCURRENCY,
                   help=f"open connections served at once; beyond it requests get 503 (default: {LIMIT_CONCURRENCY})")
    p.add_argument("--max_guide_bytes", type=int, default=ServeConfig.max_guide_bytes,
                   help="grammar bytes x n that one constrained request (response_format, tool_choice) may "
                        f"carry; larger ones get 400 (default: {ServeConfig.max_guide_bytes})")
    p.add_argument("--log_level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--generation_config", default="auto", help=GENERATION_CONFIG_HELP)
    from astrai.infer.engine import EngineConfig

    # unset engine flags leave no attribute (suppress): the engine's own defaults apply
    add_dataclass_arguments(p, EngineConfig, _engine_fields(), suppress=True, help=_engine_help,
                            aliases={"num_threads": ["--threads"]})  # the alias `astrai train` and `demo` take too
    return p


_SERVER_FLAGS = ("model", "host", "port", "api_key", "admin_key", "weights_dir", "served_model_name", "max_request_bytes", "max_waiting",
                 "body_timeout", "verify", "shutdown_timeout", "log_level", "generation_config", "header_timeout",
                 "limit_concurrency", "max_guide_bytes")


def _engine_fields() -> list[str]:
    """EngineConfig's fields become flags, so the server never lags behind the engine's knobs."""
    import dataclasses

    from astrai.infer.config import EngineConfig

    return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _SERVER_FLAGS]


def _engine_help(f: Any, default: Any) -> str:
    help_ = f.metadata.get("help", "")
    return f"engine setting (default: {default!r}){': ' + help_ if help_ else ''}"


def _graceful_server_class(state: ServerState) -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn stops accepting and waits `timeout_graceful_shutdown` for open connections, then
        cancels them mid-stream. Aborting the engine requests just before that deadline ends each
        stream properly instead: a last chunk with finish_reason "abort", then [DONE]. A model
        whose engine cannot be built (the load runs after the socket is bound) stops the server,
        as a damaged model stops it before: nothing could ever be served but 503s."""

        async def on_tick(self, counter: int) -> bool:
            return await super().on_tick(counter) or state.status == "failed"

        async def shutdown(self, sockets: Any = None) -> None:
            delay = max(0.0, (self.config.timeout_graceful_shutdown or 0.0) - 0.5)
            timer = asyncio.get_running_loop().call_later(
                delay, lambda: state.engine.abort_all() if state.engine is not None else None)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return GracefulServer


def uvicorn_config(app: Any, *, host: str, port: int, log_level: str = "info", shutdown_timeout: float = 30.0,
                   header_timeout: float = HEADER_TIMEOUT, limit_concurrency: int = LIMIT_CONCURRENCY,
                   **extra: Any) -> Any:
    """The uvicorn settings of `astrai serve` (tests start the same server in a thread)."""
    import uvicorn

    # uvicorn answers 503 once the open connections, the new one included, reach its limit: + 1
    # makes limit_concurrency the number of connections served
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=shutdown_timeout, http=header_timeout_protocol(header_timeout),
                          limit_concurrency=limit_concurrency + 1, **extra)


def _check_args(args: argparse.Namespace) -> str | None:
    """What makes this command line unusable, as one line for stderr; None when it is fine."""
    from astrai.model.hf_dir import check_device
    from astrai.model.hub import is_hub_id
    from astrai.model.lora import read_adapter, split_adapter
    from astrai.model.manifest import check_model_dir, model_argument, nearest_model_dir

    if is_hub_id(args.model):  # clients name the model as the user did, not by its snapshot hash
        args.served_model_name = args.served_model_name or args.model
    try:  # a Hub id -> its cached snapshot; a run's ckpt_dir -> its newest checkpoint
        args.model = model_argument(args.model, "astrai serve")
        base, lora = split_adapter(args.model, getattr(args, "lora", None), "astrai serve")
        if base != args.model:  # a LoRA checkpoint as --model: clients still name it as the user did
            args.served_model_name = args.served_model_name or Path(args.model).resolve().name
            args.model, args.lora = base, lora
    except (ValueError, OSError) as exc:
        return str(exc)
    if args.api_key is not None and not args.api_key.strip():
        return ("the API key is empty (--api_key or $ASTRAI_API_KEY set to ''); give a key, or unset "
                "ASTRAI_API_KEY to serve without authentication")
    if args.admin_key is not None and not args.admin_key.strip():
        return ("the admin key is empty (--admin_key or $ASTRAI_ADMIN_KEY set to ''); give a key, or unset "
                "ASTRAI_ADMIN_KEY to keep the admin routes off")
    if args.weights_dir is not None and not Path(args.weights_dir).is_dir():
        return f"--weights_dir '{args.weights_dir}' is not a directory; create it or point it at one"
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        return (f"--model '{args.model}' is not a model directory (no config.json); point it at a "
                f"directory written by astrai.save_model or a training checkpoint{nearest_model_dir(args.model)}")
    for name, minimum in (("max_waiting", 0), ("body_timeout", 1e-9), ("header_timeout", 1e-9),
                          ("limit_concurrency", 1), ("max_guide_bytes", 1)):
        value = getattr(args, name)
        if value is not None and not value >= minimum:
            return f"--{name} must be {'>= 0' if minimum == 0 else '> 0'}, got {value}"
    try:
        if getattr(args, "device", None) is not None:
            check_device(args.device)
        check_model_dir(model_dir, verify=args.verify)  # before serving: a damaged model exits, not a 503
        if getattr(args, "lora", None):
            read_adapter(args.lora, verify=args.verify)
        generation_defaults(str(model_dir), args.generation_config)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    return None


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check_args(args)
    if problem is not None:
        print(f"astrai serve: error: {problem}", file=sys.stderr)
        return 2
    if not args.api_key and not _is_loopback(args.host):
        print(f"astrai serve: warning: binding to {args.host} without an API key: anyone who can reach this "
              "port can use the model; set --api_key or $ASTRAI_API_KEY", file=sys.stderr)
    model_dir = Path(args.model)
    engine_kwargs = {k: v for k, v in vars(args).items() if k not in _SERVER_FLAGS}
    config = ServeConfig(str(model_dir), args.served_model_name, args.api_key, args.max_request_bytes,
                         engine_kwargs, args.max_waiting, args.body_timeout, args.verify,
                         generation_config=args.generation_config, max_guide_bytes=args.max_guide_bytes,
                         admin_key=args.admin_key, weights_dir=args.weights_dir)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    server_class = _graceful_server_class(app.state.serve)
    server = server_class(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                         shutdown_timeout=args.shutdown_timeout, header_timeout=args.header_timeout,
                                         limit_concurrency=args.limit_concurrency))
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler installed
    # here is what it restores and re-raises into, so a SIGTERM ends with exit status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    state = app.state.serve
    if state.status == "failed":
        print(f"astrai serve: error: the model could not be loaded: {state.error}", file=sys.stderr)
        return 2
    return 0 if server.started else 1
