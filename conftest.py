"""Test configuration: every async test runs on asyncio and trio; services are real or skipped.

``KIT_REQUIRE_SERVICES=1`` (set by .ci/run) turns a missing service into a failure instead of a
skip, so CI cannot pass by skipping.
"""
import os
import socket

import pytest

from kit_store import SQLiteStore


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request):
    return request.param


def _service(name: str, port: int) -> None:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError as exc:
        message = f"{name} is not running on 127.0.0.1:{port} ({exc})"
        if os.environ.get("KIT_REQUIRE_SERVICES") == "1":
            pytest.fail(message + "; KIT_REQUIRE_SERVICES=1 makes this a failure")
        pytest.skip(message)


@pytest.fixture
def redis_url():
    """The machine's Redis (database 15, which the tests own)."""
    _service("Redis", 6379)
    return "redis://127.0.0.1:6379/15"


@pytest.fixture
async def store(tmp_path, anyio_backend):
    """An open SQLite event store in a fresh file (test files may override it)."""
    async with SQLiteStore(tmp_path / "kit.db") as s:
        yield s
