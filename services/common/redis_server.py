"""A private redis-server on loopback, for `sluice up` without --redis-url (and for tests).

`start_redis_server()` runs the installed `redis-server` binary bound to 127.0.0.1 on a free
port, with a random password, no persistence and its files in a private temporary directory;
it waits until the server answers PING and returns a `LocalRedisServer` whose `url` carries the
password. `stop()` terminates it and removes the directory. When the binary is missing,
`find_redis_server()` returns None and the caller falls back to the in-memory store (and says so).
"""

from __future__ import annotations

import contextlib
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

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and remove its directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        shutil.rmtree(self.directory, ignore_errors=True)


def start_redis_server(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout_s: float = 10.0,
    tls_files: tuple[Path, Path, Path] | None = None,
) -> LocalRedisServer:
    """Start a private redis-server (see module docstring); raises if it cannot start.

    With `tls_files` = (CA certificate, server certificate, server key) it serves TLS only
    (its `url` is rediss://; clients verify it with that CA)."""
    binary = find_redis_server()
    if binary is None:
        raise FailedPreconditionError("redis-server is not installed")
    password = secrets.token_urlsafe(24)
    directory = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
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
                'save ""',
                "appendonly no",
                "daemonize no",
                f"logfile {directory / 'redis.log'}",
            )
        )
        + "\n"
    )
    config_path.chmod(0o600)
    process = subprocess.Popen(  # noqa: S603 - fixed binary, our own config file
        # Through the wrapper that ties it to this process: it never outlives a launcher
        # killed with SIGKILL (services/common/processes.py).
        [sys.executable, "-m", "services.common.processes", binary, str(config_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=tied_env(),
        start_new_session=True,
    )
    server = LocalRedisServer(
        process, host, chosen_port, password, directory, tls_files[0] if tls_files else None
    )
    try:
        _wait_ready(server, startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    log.info("started private redis-server on %s:%d (pid %d)", host, chosen_port, process.pid)
    return server


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


def redis_for_stack(redis_url: str | None) -> tuple[str | None, LocalRedisServer | None]:
    """What `sluice up` uses: the given URL; else a private server when the binary exists;
    else (None, None), meaning the in-memory store (logged here, so it is said at start-up).
    The caller stops the returned server on exit."""
    if redis_url:
        return redis_url, None
    if find_redis_server() is None:
        log.warning(
            "redis-server is not installed and no --redis-url was given: using an in-memory "
            "store (one router; registry, keys, limits and idempotency are not shared)"
        )
        return None, None
    server = start_redis_server()
    return server.url, server
