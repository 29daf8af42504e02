"""The adapter registry over the in-memory store, and the adapter record's rules and codecs."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from services.common.protocol.adapter_record import (
    AdapterRecord,
    validate_adapter_name,
    validate_adapter_path,
)
from services.common.redis_store import MemoryStore
from services.router.adapter_registry import ADAPTERS_HASH, AdapterRegistry


class SharedMemoryStore(MemoryStore):
    """A memory store that says it is shared, standing in for one Redis seen by two routers."""

    @property
    def shared(self) -> bool:
        return True


def record(name: str = "support-v1", path: str = "support/v1") -> AdapterRecord:
    return AdapterRecord(
        name=name, path=path, sha256="ab" * 32, rank=8, target_modules=("q_proj", "v_proj")
    )


@pytest.mark.parametrize("name", ["a", "support-v1", "x.y_z-1", "A" * 128])
def test_valid_names(name: str) -> None:
    assert validate_adapter_name(name) == name


@pytest.mark.parametrize("name", ["", "-x", ".hidden", "a b", "a/b", "a:b", "ü", "A" * 129, None])
def test_invalid_names_say_the_rule(name) -> None:
    with pytest.raises(InvalidArgumentError, match="letters, digits|non-empty"):
        validate_adapter_name(name)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("", "relative"),
        ("https://example.com/a", "URL"),
        ("s3://bucket/a", "URL"),
        ("/etc/passwd", "relative"),
        ("~/adapters/a", "relative"),
        ("../outside", "'..'"),
        ("a/../../b", "'..'"),
        ("a\\..\\b", "'..'"),
        ("a\x00b", "NUL"),
    ],
)
def test_paths_must_stay_under_the_root(path: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError, match=reason):
        validate_adapter_path(path)


def test_record_round_trips_through_json_and_protobuf() -> None:
    original = record()
    assert AdapterRecord.from_json(original.to_json()) == original
    spec = original.to_pb()
    assert (spec.name, spec.path, spec.rank, list(spec.target_modules)) == (
        "support-v1",
        "support/v1",
        8,
        ["q_proj", "v_proj"],
    )
    back = AdapterRecord.from_pb(spec)
    assert (back.name, back.path, back.sha256, back.rank, back.target_modules) == (
        original.name,
        original.path,
        original.sha256,
        original.rank,
        original.target_modules,
    )
    with pytest.raises(InvalidArgumentError, match="malformed"):
        AdapterRecord.from_json('{"path": "x"}')


def test_add_list_remove_in_memory() -> None:
    async def scenario() -> None:
        registry = AdapterRegistry()
        await registry.start()
        assert registry.records() == [] and await registry.lookup("support-v1") is None
        await registry.add(record("b"))
        await registry.add(record("a"))
        assert [r.name for r in registry.records()] == ["a", "b"]
        assert (registry.get("a").path, registry.get("a").rank) == ("support/v1", 8)
        with pytest.raises(AlreadyExistsError, match="already registered"):
            await registry.add(record("a"))
        removed = await registry.remove("a")
        assert removed.name == "a" and registry.names() == {"b"}
        with pytest.raises(NotFoundError, match="unknown adapter"):
            await registry.remove("a")

    asyncio.run(scenario())


def test_two_routers_on_one_store_see_each_others_adapters() -> None:
    async def scenario() -> None:
        store = SharedMemoryStore()
        first, second = AdapterRegistry(store, refresh_s=0.05), AdapterRegistry(store)
        await first.start()
        await second.add(record("shared"))
        # A name missing from the view is looked up in the store once, so a request never
        # waits for the refresh to name an adapter that was just registered elsewhere.
        assert "shared" not in first.names()
        assert (await first.lookup("shared")).name == "shared"
        with pytest.raises(AlreadyExistsError):
            await first.add(record("shared"))
        await second.remove("shared")
        await asyncio.sleep(0.2)  # the background refresh drops it from the first's view
        assert first.names() == set() and await first.lookup("shared") is None
        await first.stop()

    asyncio.run(scenario())


def test_malformed_entries_are_skipped() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        await store.hash_set(ADAPTERS_HASH, "bad", "not json at all {")
        await store.hash_set(ADAPTERS_HASH, "ok", record("ok").to_json())
        registry = AdapterRegistry(store)
        await registry.refresh()
        assert registry.names() == {"ok"}

    asyncio.run(scenario())
