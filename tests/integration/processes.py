"""/proc helpers shared by the tests that check no process outlives its parent, the start of a
real `sluice up` as a user runs it (Linux only), and an engine's Info over gRPC."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc

from protos.sluice.v1 import engine_pb2, engine_pb2_grpc
from services.common.ports import free_port

TINY_UP_ARGS = (
    *("--model", "dummy:tiny", "--engines", "2", "--kv-cache-bytes", str(8 * 1024**2)),
    *("--metrics-port", "0"),  # no fixed ports: a test may start while an earlier stack drains
)


def child_pids(parent: int) -> list[int]:
    """Direct children of `parent`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent:
            pids.append(int(entry.name))
    return pids


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of `pid`."""
    found, pending = [], [pid]
    while pending:
        children = child_pids(pending.pop())
        found += children
        pending += children
    return found


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def wait_until_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until none of `pids` is alive or the timeout passes; the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if pid_alive(pid)]


def start_sluice_up(*extra: str) -> tuple[subprocess.Popen[str], int]:
    """`sluice up` on a free port with the tiny model and two engines; (process, port)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), *TINY_UP_ARGS, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # children's logs
        text=True,
    )
    return process, port


async def engine_info(address: str) -> engine_pb2.EngineInfo:
    """The engine's Engine.Info at `address` (5 s deadline)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return await stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
