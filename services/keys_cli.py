"""`sluice keys add|list|revoke`: manage the API keys that routers check, stored in Redis.

    sluice keys add --name alice [--requests-per-minute 60] [--tokens-per-minute 20000] \
        --redis-url redis://:PASSWORD@host:6379/0
    sluice keys list --redis-url ...
    sluice keys revoke key_0123abcd --redis-url ...

`add` prints the new key once (only its hash is stored); `list` prints ids, names, display
prefixes and limits, never keys. The Redis URL and password can also come from SLUICE_REDIS_URL /
SLUICE_REDIS_PASSWORD, and the pepper from SLUICE_API_KEY_PEPPER (the routers must use the same).
Exit status: 0 on success, 2 on a usage error, 1 when Redis is unreachable or the key is unknown.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from services.common.config import add_arguments, from_layers
from services.common.errors import SluiceError
from services.common.redis_store import StoreConfig, open_store
from services.router.api_keys import ApiKeyConfig, ApiKeyStore
from services.router.rate_limit import RateLimits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice keys", description="Manage API keys in Redis.")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="create a key and print it once")
    add.add_argument("--name", required=True, help="who or what the key is for")
    add.add_argument("--requests-per-minute", type=int, default=0, help="0 = unlimited")
    add.add_argument("--tokens-per-minute", type=int, default=0, help="0 = unlimited")
    listing = commands.add_parser("list", help="list keys (ids, names, prefixes, limits)")
    revoke = commands.add_parser("revoke", help="revoke a key by id (or by the key itself)")
    revoke.add_argument("key_id", help="the key's id (key_...) as shown by list")
    for sub in (add, listing, revoke):
        add_arguments(sub, StoreConfig)
        add_arguments(sub, ApiKeyConfig)
    return parser


async def _run(args: argparse.Namespace) -> int:
    store_config = from_layers(StoreConfig, args)
    if store_config.redis_url is None:
        print("error: --redis-url (or SLUICE_REDIS_URL) is required", file=sys.stderr)
        return 2
    store = open_store(store_config)
    keys = ApiKeyStore(store, from_layers(ApiKeyConfig, args))
    try:
        if args.command == "add":
            limits = RateLimits(args.requests_per_minute, args.tokens_per_minute)
            raw_key, record = await keys.add(args.name, limits)
            print(f"created {record.key_id} ({record.name}); this key is shown only once:")
            print(raw_key)
        elif args.command == "list":
            records = await keys.list_keys()
            print(f"{'id':<18} {'name':<20} {'prefix':<16} {'req/min':>8} {'tok/min':>8}  created")
            for record in records:
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.created_at))
                print(
                    f"{record.key_id:<18} {record.name:<20} {record.display_prefix + '…':<16} "
                    f"{record.requests_per_minute:>8} {record.tokens_per_minute:>8}  {created}Z"
                )
        else:
            record = await keys.revoke(args.key_id)
            print(f"revoked {record.key_id} ({record.name})")
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2 if exc.code == "INVALID_ARGUMENT" else 1
    finally:
        await store.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `sluice keys ...`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return asyncio.run(_run(args))
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
