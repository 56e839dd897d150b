"""`astrai ckpt`: list, verify or pick the training checkpoints of a ckpt_dir.

A thin command over the checkpoint modules: `list` shows each step directory's size and status
(complete, incomplete, leftover of a killed save, legacy), `verify` recomputes the manifest's
checksums (publish.py's `verify_checkpoint`), and `latest` prints what `--resume` and the
container entrypoint would continue from (checkpoint.py's `checkpoint_to_resume`). cli.py
dispatches `astrai ckpt` to `main`; nothing imports this module.
"""

from __future__ import annotations

import sys
from pathlib import Path

from astrai.flags import ArgumentParser
from astrai.model.manifest import newest_checkpoint
from astrai.train.checkpoint import checkpoint_to_resume
from astrai.train.publish import (
    HIDDEN_DIR,
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    is_complete,
    read_manifest,
    verify_checkpoint,
)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _cmd_list(ckpt_dir: Path, verify: bool = False) -> int:
    if not ckpt_dir.is_dir():
        print(f"astrai ckpt list: {ckpt_dir} is not a directory", file=sys.stderr)
        return 2
    rows = []
    for p in sorted(ckpt_dir.iterdir()):
        if p.is_dir() and (STEP_DIR.match(p.name) or HIDDEN_DIR.match(p.name)):
            if HIDDEN_DIR.match(p.name):
                status = "leftover (ignored; removed at the next start)"
            elif (p / MANIFEST).exists():
                status = "complete" if is_complete(p) else "INCOMPLETE"
                if verify and status == "complete":  # sizes match; --verify also reads every byte
                    status = "complete, verified" if is_complete(p, checksums=True) else "DAMAGED (checksum)"
            else:
                status = "legacy (no manifest)"
            rows.append(f"{p.name:<40} {_dir_bytes(p) / 1e6:>10.1f} MB  {status}")
    print("\n".join(rows) if rows else f"no checkpoints in {ckpt_dir}")
    latest = newest_checkpoint(ckpt_dir, "sizes").path
    print(f"latest complete: {latest.name if latest else 'none'}")
    return 0


def _cmd_verify(target: Path) -> int:
    if (target / MANIFEST).exists() or STEP_DIR.match(target.name):
        paths = [target]
    else:
        paths = sorted(p for p in target.iterdir() if p.is_dir() and STEP_DIR.match(p.name)) if target.is_dir() else []
        if not paths:
            print(f"astrai ckpt verify: no checkpoints in {target}", file=sys.stderr)
            return 2
    failed = 0
    for p in paths:
        try:
            verify_checkpoint(p)
            print(f"OK      {p} ({len(read_manifest(p)['files'])} files, {_dir_bytes(p) / 1e6:.1f} MB)")
        except CheckpointError as e:
            failed += 1
            print(f"FAILED  {e}")
    return 1 if failed else 0


def _cmd_latest(ckpt_dir: Path) -> int:
    """The checkpoint `--resume` (and the container entrypoint) would continue from."""
    try:
        print(checkpoint_to_resume(ckpt_dir, asker="astrai ckpt latest"))
    except CheckpointError as e:
        print(f"astrai ckpt latest: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai ckpt", description="List, verify or pick training checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    list_cmd = sub.add_parser("list", help="checkpoints in a ckpt_dir, their size and status")
    list_cmd.add_argument("dir", type=Path)
    list_cmd.add_argument("--verify", action="store_true", help="also recompute checksums; mark damaged ones")
    sub.add_parser(
        "verify", help="recompute the checksums of one checkpoint, or of every checkpoint in a ckpt_dir"
    ).add_argument("dir", type=Path)
    sub.add_parser(
        "latest", help="print the newest complete checkpoint in a ckpt_dir (what --resume picks), or exit 1"
    ).add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "list":
        return _cmd_list(args.dir, args.verify)
    commands = {"verify": _cmd_verify, "latest": _cmd_latest}
    return commands[args.command](args.dir)


if __name__ == "__main__":
    raise SystemExit(main())
