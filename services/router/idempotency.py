"""Idempotent requests: a retried request id returns the same result without a second generation.

A client may send a request id. The router hashes the request's payload (`payload_hash`, over the
deterministic protobuf serialization minus the id) and calls `claim(request_id, payload_hash)`:
- nobody has it → `ClaimKind.NEW`: this router generates, `append`s each response message
  (opaque bytes, e.g. serialized GenerateResponse) as it streams, then `complete`s (results kept
  `result_ttl_s`) or `abandon`s on failure (the record is deleted so a retry can run again: errors
  are not cached, and in-flight work is not replayed blindly after a crash either — the record of
  a crashed owner expires after `lease_s` without appends and a retry starts afresh);
- the same id with the same payload finished → `ClaimKind.DONE`, `replay()` yields the stored
  messages;
- the same id with the same payload still running (on this or another router) →
  `ClaimKind.IN_FLIGHT`, `replay()` yields what was streamed so far and follows the stream until it
  completes (or raises UnavailableError if the owner disappears);
- the same id with a different payload → AlreadyExistsError.
Records live in the shared store: `sluice:idem:<id>` (JSON: payload hash, state) and
`sluice:idem:<id>:chunks` (a list of messages). When the store is unreachable, claims degrade to
NEW without a record (serving continues; duplicates are then possible) and the caller is told via
`Claim.recorded = False`. No torch, no gRPC.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.errors import AlreadyExistsError, InvalidArgumentError, UnavailableError
from services.common.redis_store import SharedStore, StoreUnavailableError

log = logging.getLogger(__name__)

KEY_PREFIX = "sluice:idem:"
MAX_REQUEST_ID_LENGTH = 512


class ClaimKind(enum.Enum):
    NEW = "new"
    DONE = "done"
    IN_FLIGHT = "in_flight"


@dataclass(frozen=True)
class Claim:
    """The answer to `claim`: what the caller should do with this request id."""

    kind: ClaimKind
    request_id: str
    recorded: bool = True


def scoped_id(tenant: str, request_id: str) -> str:
    """The id to record: the client's id within its tenant (API key id), so that one tenant's
    id can never return another tenant's result."""
    return f"{tenant}/{request_id}" if tenant else request_id


def payload_hash(payload: bytes) -> str:
    """A stable digest of a request's payload (serialize deterministically, without the id)."""
    return hashlib.sha256(payload).hexdigest()


class IdempotencyCache:
    """Shared record of requests by id (module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        *,
        result_ttl_s: float = 600.0,
        lease_s: float = 30.0,
        poll_interval_s: float = 0.02,
    ) -> None:
        if not (result_ttl_s > 0 and lease_s > 0 and poll_interval_s > 0):
            raise InvalidArgumentError("idempotency TTLs and poll interval must be > 0")
        self.store = store
        self.result_ttl_s = result_ttl_s
        self.lease_s = lease_s
        self.poll_interval_s = poll_interval_s
        self._owned: dict[str, str] = {}  # request id -> payload hash, claimed by this process

    @staticmethod
    def _meta_key(request_id: str) -> str:
        return KEY_PREFIX + request_id

    @staticmethod
    def _chunks_key(request_id: str) -> str:
        return KEY_PREFIX + request_id + ":chunks"

    @staticmethod
    def _validate(request_id: str) -> None:
        if not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidArgumentError(
                f"request_id must be 1..{MAX_REQUEST_ID_LENGTH} characters long"
            )

    async def claim(self, request_id: str, digest: str) -> Claim:
        """Claim `request_id` for a payload with this digest (see module docstring)."""
        self._validate(request_id)
        meta = json.dumps({"payload": digest, "state": "running", "started": time.time()})
        try:
            if await self.store.set(
                self._meta_key(request_id), meta, ttl_s=self.lease_s, only_if_absent=True
            ):
                await self.store.delete(self._chunks_key(request_id))
                self._owned[request_id] = digest
                return Claim(ClaimKind.NEW, request_id)
            existing = await self.store.get(self._meta_key(request_id))
        except StoreUnavailableError:
            log.warning("idempotency store unreachable: request %r runs unrecorded", request_id)
            return Claim(ClaimKind.NEW, request_id, recorded=False)
        if existing is None:  # expired between the two calls: try once more
            return await self.claim(request_id, digest)
        record = json.loads(existing)
        if record.get("payload") != digest:
            raise AlreadyExistsError(
                f"request id {request_id!r} was already used with a different payload"
            )
        kind = ClaimKind.DONE if record.get("state") == "done" else ClaimKind.IN_FLIGHT
        return Claim(kind, request_id)

    async def append(self, request_id: str, message: bytes) -> None:
        """Record one response message of a request this process claimed (renews the lease)."""
        if request_id not in self._owned:
            return
        try:
            await self.store.list_append(self._chunks_key(request_id), message, ttl_s=self.lease_s)
            await self.store.expire(self._meta_key(request_id), self.lease_s)
        except StoreUnavailableError:
            log.warning("idempotency store unreachable while recording %r", request_id)

    async def complete(self, request_id: str) -> None:
        """Mark the request finished; its messages are kept for `result_ttl_s`."""
        digest = self._owned.pop(request_id, None)
        if digest is None:
            return
        meta = json.dumps({"payload": digest, "state": "done", "finished": time.time()})
        try:
            await self.store.expire(self._chunks_key(request_id), self.result_ttl_s)
            await self.store.set(self._meta_key(request_id), meta, ttl_s=self.result_ttl_s)
        except StoreUnavailableError:
            log.warning("idempotency store unreachable: result of %r not kept", request_id)

    async def abandon(self, request_id: str) -> None:
        """Forget a claimed request that failed, so that a retry runs it again."""
        if self._owned.pop(request_id, None) is None:
            return
        try:
            await self.store.delete(self._meta_key(request_id), self._chunks_key(request_id))
        except StoreUnavailableError:
            log.warning("idempotency store unreachable: %r expires with its lease", request_id)

    async def replay(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> AsyncIterator[bytes]:
        """The messages of a DONE or IN_FLIGHT request, following it live until it completes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        position = 0
        while True:
            try:
                raw_meta = await self.store.get(self._meta_key(request_id))
                chunks = await self.store.list_range(self._chunks_key(request_id), position)
            except StoreUnavailableError as exc:
                raise UnavailableError(f"cannot follow request {request_id!r} right now") from exc
            for chunk in chunks:
                yield chunk
            position += len(chunks)
            if raw_meta is None:
                raise UnavailableError(
                    f"the first attempt of request {request_id!r} was lost; retry it"
                )
            if json.loads(raw_meta).get("state") == "done":
                return  # state was read first: every message was appended before it was done
            if deadline is not None and time.monotonic() > deadline:
                raise UnavailableError(f"request {request_id!r} is still running elsewhere")
            await asyncio.sleep(self.poll_interval_s)
