"""Start, stop and inspect a SeaweedFS server for manual runs and benchmarks.

    python scripts/seaweedfs.py start [--dir DIR] [--mount MNT] [--tls] [--access-key K]
                                      [--secret-key S]
    python scripts/seaweedfs.py status
    python scripts/seaweedfs.py stop

``start`` runs ``weed mini`` on free 127.0.0.1 ports (and ``weed mount`` at MNT if asked), leaves
it running, and writes a JSON state file (``DIR/state.json``; ``--state`` elsewhere) with the
PIDs and endpoints; ``stop`` unmounts and stops exactly those PIDs. The same classes serve the
test fixtures: ``ckptstore.testing.servers``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptstore.testing.servers import (
    SeaweedFS,
    ServerError,
    process_is,
    remove_grpc_sockets,
    stop_pid,
    unmount,
)

DEFAULT_DIR = Path(tempfile.gettempdir()) / "ckptstore-seaweedfs"


def _state_path(args: argparse.Namespace) -> Path:
    return Path(args.state) if args.state else Path(args.dir) / "state.json"


def start(args: argparse.Namespace) -> int:
    state_path = _state_path(args)
    if state_path.exists():
        state = json.loads(state_path.read_text())
        if process_is(state["pid"], "weed"):
            print(f"already running (pid {state['pid']}); state in {state_path}")
            return 1
    server = SeaweedFS(
        args.dir,
        access_key=args.access_key,
        secret_key=args.secret_key,
        tls=args.tls,
        tie_to_parent=False,
    )
    server.start()
    state = server.describe()
    if args.mount:
        try:
            mount = server.mount(args.mount)
        except ServerError:
            server.stop()
            raise
        state["mount"] = {"pid": mount.pid, "path": str(mount.path), "log": str(mount.log_path)}
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps(state, indent=2))
    print(json.dumps(state, indent=2))
    print(f"state written to {state_path}; stop with: python {sys.argv[0]} stop", file=sys.stderr)
    return 0


def stop(args: argparse.Namespace) -> int:
    state_path = _state_path(args)
    if not state_path.exists():
        print(f"no state file at {state_path}; nothing to stop")
        return 1
    state = json.loads(state_path.read_text())
    if "mount" in state:
        unmount(state["mount"]["path"])
        stop_pid(state["mount"]["pid"], program="weed")
    stop_pid(state["pid"], program="weed", timeout=30.0)
    remove_grpc_sockets(state["ports"])
    state_path.unlink()
    print(f"stopped pid {state['pid']}")
    return 0


def status(args: argparse.Namespace) -> int:
    state_path = _state_path(args)
    if not state_path.exists():
        print(f"not running (no state file at {state_path})")
        return 1
    state = json.loads(state_path.read_text())
    alive = process_is(state["pid"], "weed")
    print(json.dumps({**state, "running": alive}, indent=2))
    return 0 if alive else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--dir", default=str(DEFAULT_DIR), help="data, logs and state")
    parser.add_argument("--state", default=None, help="state file (default DIR/state.json)")
    parser.add_argument("--mount", default=None, help="also mount the filer here over FUSE")
    parser.add_argument("--tls", action="store_true", help="also serve S3 over HTTPS")
    parser.add_argument("--access-key", default=None)
    parser.add_argument("--secret-key", default=None)
    args = parser.parse_args(argv)
    return {"start": start, "stop": stop, "status": status}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
