"""The router's adapter admin calls: AddAdapter, ListAdapters, RemoveAdapter (any front).

Adding checks the caller's API key (when keys are on), the name and the path's form, that the
name is free, then asks one ready engine's `InspectAdapter` to check the files against the
served model (the engine resolves the path under its `--adapter-root`, refuses what it cannot
serve with INVALID_ARGUMENT or NOT_FOUND and the reason, and records the SHA-256), and stores
the engine's description in the registry. Requests then name the adapter; the router sends the
stored spec with each submit, so engines load exactly the files that were checked. Removing
unregisters (requests already admitted finish). Listing says where each adapter is resident.
No adapter may be named `base` or like the served model: OpenAI clients select the served model
without an adapter by those names (`"model": "base"`).
"""

from __future__ import annotations

from collections.abc import Iterable

from protos.sluice.v1 import router_pb2
from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from services.common.protocol.adapter_record import (
    AdapterRecord,
    validate_adapter_name,
    validate_adapter_path,
)
from services.router.core import RouterCore

Metadata = Iterable[tuple[str, str | bytes]] | None
BASE_MODEL_ALIAS = "base"  # the served model without an adapter, as a request's model name


def adapter_info(record: AdapterRecord, resident_on: Iterable[str] = ()) -> router_pb2.AdapterInfo:
    return router_pb2.AdapterInfo(
        name=record.name,
        rank=record.rank,
        path=record.path,
        sha256=record.sha256,
        target_modules=record.target_modules,
        resident_on=sorted(resident_on),
    )


def adapter_infos(core: RouterCore) -> list[router_pb2.AdapterInfo]:
    """Every registered adapter with the engines that hold it in a device slot now."""
    where: dict[str, list[str]] = {}
    for capacity in core.pool.capacities():
        for name in capacity.resident_adapters:
            where.setdefault(name, []).append(capacity.engine_id)
    return [adapter_info(r, where.get(r.name, ())) for r in core.adapters.records()]


async def add_adapter(
    core: RouterCore, request: router_pb2.AddAdapterRequest, metadata: Metadata
) -> router_pb2.AdapterInfo:
    core.auth.check(metadata)
    name = validate_adapter_name(request.name)
    path = validate_adapter_path(request.path)
    connections = core.pool.ready_connections()
    if name == BASE_MODEL_ALIAS or (connections and name == connections[0].info.model):
        raise InvalidArgumentError(
            f"adapter name {name!r} is reserved: it names the served model without an adapter"
        )
    await core.adapters.check_free(name)
    if not connections:
        raise UnavailableError("no engine is ready to check the adapter; retry shortly")
    engine = min(connections, key=lambda c: (c.capacity.inflight, c.engine_id))
    spec = await engine.inspect_adapter(name, path, core.config.adapter_inspect_timeout_s)
    if spec.name and spec.name != name:
        raise FailedPreconditionError(
            f"engine {engine.engine_id} described adapter {spec.name!r} when asked for {name!r}"
        )
    spec.name = name
    spec.path = spec.path or path
    if not spec.sha256:
        raise FailedPreconditionError(
            f"engine {engine.engine_id} gave no checksum for adapter {name!r}"
        )
    record = await core.adapters.add(AdapterRecord.from_pb(spec))
    return adapter_info(record)


def list_adapters(core: RouterCore, metadata: Metadata) -> router_pb2.ListAdaptersResponse:
    core.auth.check(metadata)
    return router_pb2.ListAdaptersResponse(adapters=adapter_infos(core))


async def remove_adapter(
    core: RouterCore, request: router_pb2.RemoveAdapterRequest, metadata: Metadata
) -> router_pb2.AdapterInfo:
    core.auth.check(metadata)
    record = await core.adapters.remove(validate_adapter_name(request.name))
    return adapter_info(record)
