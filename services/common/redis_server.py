"""A private redis-server on loopback, for `sluice up` without --redis-url (and for tests).

`start_redis_server()` runs the installed `redis-server` binary bound to 127.0.0.1 on a free
port, with a random password; it waits until the server answers PING and returns a
`LocalRedisServer` whose `url` carries the password. Without `data_dir` its files live in a
private temporary directory with no persistence, removed by `stop()`. With `data_dir` (what
`sluice up` passes: `<cache dir>/redis`) it persists every write in an append-only file there,
so API keys, the adapter registry and idempotency records survive a crash of the server and a
restart of the stack; the directory is locked while a server uses it (a second stack on the same
cache directory gets a temporary, non-persistent one and a warning). `restart()` starts a
crashed server again on the same port with the same password, so clients reconnect unchanged.
When the binary is missing, `find_redis_server()` returns None and the caller falls back to the
in-memory store (and says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.common.errors import FailedPreconditionError, UnavailableError
from services.common.ports import free_port
from services.common.processes import tied_env

log = logging.getLogger(__name__)

_CANDIDATES = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    """Path of the redis-server binary, or None when it is not installed."""
    found = shutil.which("redis-server")
    if found:
        return found
    for candidate in _CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    return None


@dataclass
class LocalRedisServer:
    """A running private redis-server; `url` includes its password."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    password: str
    directory: Path
    tls_ca_file: Path | None = None
    persistent: bool = False  # directory holds an append-only file that outlives the server
    lock_file: IO[bytes] | None = field(default=None, repr=False)  # held while persistent
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.directory / "redis.log"

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls_ca_file else "redis"
        return f"{scheme}://:{self.password}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def config_path(self) -> Path:
        return self.directory / "redis.conf"

    def restart(self, startup_timeout_s: float = 10.0) -> None:
        """Start the server again (same port, password and files) after it exited."""
        if self.running():
            raise FailedPreconditionError("redis-server is still running")
        self.process = _spawn(self.config_path)
        _wait_ready(self, startup_timeout_s)
        log.info("restarted private redis-server on %s:%d", self.host, self.port)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL); remove a temporary directory.

        SIGTERM makes redis-server flush its append-only file before it exits."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        if self.lock_file is not None:
            self.lock_file.close()  # releases the directory's lock
            self.lock_file = None
        if not self.persistent:
            shutil.rmtree(self.directory, ignore_errors=True)


def start_redis_server(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout_s: float = 10.0,
    tls_files: tuple[Path, Path, Path] | None = None,
    data_dir: Path | None = None,
) -> LocalRedisServer:
    """Start a private redis-server (see module docstring); raises if it cannot start.

    With `tls_files` = (CA certificate, server certificate, server key) it serves TLS only
    (its `url` is rediss://; clients verify it with that CA). With `data_dir` it persists there
    (append-only file); FailedPreconditionError if another server holds that directory."""
    if find_redis_server() is None:
        raise FailedPreconditionError("redis-server is not installed")
    password = secrets.token_urlsafe(24)
    lock_file: IO[bytes] | None = None
    if data_dir is None:
        directory = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
    else:
        directory = Path(data_dir)
        directory.mkdir(parents=True, exist_ok=True)
        lock_file = _lock(directory)
    directory.chmod(0o700)
    chosen_port = port if port is not None else free_port(host)
    config_path = directory / "redis.conf"
    if tls_files is None:
        listen = [f"port {chosen_port}"]
    else:
        ca_file, cert_file, key_file = tls_files
        listen = [
            "port 0",
            f"tls-port {chosen_port}",
            f"tls-cert-file {cert_file}",
            f"tls-key-file {key_file}",
            f"tls-ca-cert-file {ca_file}",
            "tls-auth-clients no",
        ]
    config_path.write_text(
        "\n".join(
            (
                f"bind {host}",
                *listen,
                f"requirepass {password}",
                "protected-mode yes",
                f"dir {directory}",
                'save ""',  # no snapshots: the append-only file (when persistent) is the record
                f"appendonly {'no' if data_dir is None else 'yes'}",
                "appendfsync everysec",
                "daemonize no",
                f"logfile {directory / 'redis.log'}",
            )
        )
        + "\n"
    )
    config_path.chmod(0o600)
    server = LocalRedisServer(
        _spawn(config_path),
        host,
        chosen_port,
        password,
        directory,
        tls_files[0] if tls_files else None,
        persistent=data_dir is not None,
        lock_file=lock_file,
    )
    try:
        _wait_ready(server, startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    log.info(
        "started private redis-server on %s:%d (pid %d, %s)",
        host,
        chosen_port,
        server.pid,
        f"persistent in {directory}" if server.persistent else "not persistent",
    )
    return server


def _spawn(config_path: Path) -> subprocess.Popen[bytes]:
    binary = find_redis_server()
    if binary is None:
        raise FailedPreconditionError("redis-server is not installed")
    return subprocess.Popen(  # noqa: S603 - fixed binary, our own config file
        # Through the wrapper that ties it to this process: it never outlives a launcher
        # killed with SIGKILL (services/common/processes.py).
        [sys.executable, "-m", "services.common.processes", binary, str(config_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=tied_env(),
        start_new_session=True,
    )


def _lock(directory: Path) -> IO[bytes]:
    """Hold an exclusive lock on `directory` (released when the returned file is closed)."""
    lock_file = open(directory / "lock", "ab")  # noqa: SIM115 - held open while the server runs
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock_file.close()
        raise FailedPreconditionError(
            f"{directory} is in use by another private redis-server"
        ) from None
    return lock_file


def _wait_ready(server: LocalRedisServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.running():
            raise UnavailableError(f"redis-server exited at start-up; see {server.log_path}")
        if _ping(server):
            return
        time.sleep(0.05)
    raise UnavailableError(f"redis-server did not answer within {timeout_s:.0f} s")


def _ping(server: LocalRedisServer) -> bool:
    payload = f"AUTH {server.password}\r\nPING\r\n".encode()
    with (
        contextlib.suppress(OSError),
        socket.create_connection((server.host, server.port), timeout=0.5) as raw_socket,
    ):
        sock = raw_socket
        if server.tls_ca_file is not None:
            context = ssl.create_default_context(cafile=str(server.tls_ca_file))
            context.check_hostname = False
            sock = context.wrap_socket(raw_socket)
        sock.sendall(payload)
        received = b""
        while b"PONG" not in received:
            chunk = sock.recv(256)
            if not chunk:
                return False
            received += chunk
        return True
    return False


def redis_for_stack(
    redis_url: str | None, data_dir: Path | None = None
) -> tuple[str | None, LocalRedisServer | None]:
    """What `sluice up` uses: the given URL; else a private server when the binary exists
    (persistent in `data_dir` when given and free); else (None, None), meaning the in-memory
    store (logged here, so it is said at start-up). The caller stops the returned server."""
    if redis_url:
        return redis_url, None
    if find_redis_server() is None:
        log.warning(
            "redis-server is not installed and no --redis-url was given: using an in-memory "
            "store (one router; registry, keys, limits and idempotency are not shared)"
        )
        return None, None
    if data_dir is not None:
        try:
            server = start_redis_server(data_dir=data_dir)
        except FailedPreconditionError as exc:
            log.warning("%s: this stack's Redis state will not persist", exc)
        else:
            return server.url, server
    server = start_redis_server()
    return server.url, server
