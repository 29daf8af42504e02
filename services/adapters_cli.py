"""`sluice adapters add|list|remove`: register LoRA adapters with a running router, by name.

    sluice adapters add support-v1 support/v1 [--target HOST:PORT] [--api-key KEY]
    sluice adapters list [--target HOST:PORT]
    sluice adapters remove support-v1 [--target HOST:PORT]

PATH is a directory (adapter_config.json + adapter_model.safetensors) relative to the engines'
`--adapter-root`; the router has an engine check it against the served model and records its
checksum, then requests may name the adapter. The API key can also come from SLUICE_API_KEY.
Errors print `error: <STATUS>: <message>`. Exit status: 0 on success, 2 on a usage error or a
refused name or path (INVALID_ARGUMENT), 1 otherwise (router unreachable, NOT_FOUND,
ALREADY_EXISTS, UNAUTHENTICATED, ...).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from protos.sluice.v1 import router_pb2, router_pb2_grpc
from services.common import env

DEFAULT_TARGET = "127.0.0.1:50051"
CALL_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice adapters", description="Register, list and remove LoRA adapters by name."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="register an adapter directory under a name")
    add.add_argument("name", help="the name requests will use (letters, digits, - _ .)")
    add.add_argument("path", help="its directory, relative to the engines' --adapter-root")
    listing = commands.add_parser("list", help="list registered adapters and where they are")
    remove = commands.add_parser("remove", help="unregister an adapter")
    remove.add_argument("name", help="the adapter's name")
    for sub in (add, listing, remove):
        sub.add_argument(
            "--target", default=DEFAULT_TARGET, help="router host:port (default: %(default)s)"
        )
        sub.add_argument("--api-key", help="API key, when the router requires one")
        sub.add_argument(
            "--timeout-s",
            type=float,
            default=CALL_TIMEOUT_S,
            help="seconds the call may take (default: %(default)s)",
        )
    return parser


def _describe(info: router_pb2.AdapterInfo) -> str:
    modules = ",".join(info.target_modules) or "-"
    return (
        f"{info.name} (path {info.path}, rank {info.rank}, {modules}, sha256 {info.sha256[:12]}…)"
    )


def _run(args: argparse.Namespace) -> int:
    api_key = args.api_key or env.setting("api_key")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    with grpc.insecure_channel(args.target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        if args.command == "add":
            request = router_pb2.AddAdapterRequest(name=args.name, path=args.path)
            info = stub.AddAdapter(request, timeout=args.timeout_s, metadata=metadata)
            print(f"registered {_describe(info)}")
        elif args.command == "list":
            reply = stub.ListAdapters(
                router_pb2.ListAdaptersRequest(), timeout=args.timeout_s, metadata=metadata
            )
            print(f"{'name':<24} {'rank':>4}  {'modules':<40} {'resident on':<24} path")
            for info in reply.adapters:
                modules = ",".join(info.target_modules) or "-"
                resident = ",".join(info.resident_on) or "-"
                print(f"{info.name:<24} {info.rank:>4}  {modules:<40} {resident:<24} {info.path}")
        else:
            request = router_pb2.RemoveAdapterRequest(name=args.name)
            info = stub.RemoveAdapter(request, timeout=args.timeout_s, metadata=metadata)
            print(f"removed {info.name}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `sluice adapters ...`; returns the exit status."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        return _run(args)
    except grpc.RpcError as error:
        code = error.code()
        details = error.details()
        if code == grpc.StatusCode.UNAVAILABLE and "router" not in (details or ""):
            details = f"cannot reach the router at {args.target}: {details}"
        print(f"error: {code.name}: {details}", file=sys.stderr)
        return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
