"""Test configuration: every async test runs on asyncio and trio; services (Redis, a browser)
are real or skipped.

``KIT_REQUIRE_SERVICES=1`` (set by .ci/run) turns a missing service into a failure instead of a
skip, so CI cannot pass by skipping.
"""
import os
import socket
import sys
import uuid

import pytest

from kit_store import SQLiteStore


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request):
    return request.param


@pytest.fixture(autouse=True)
def no_conversations_of_other_tests():
    """Each test starts with no in-process conversations: they outlive a deck, as they do in
    any process (kit_sessions), and tests reuse session ids."""
    sessions = sys.modules.get("kit_sessions")  # (not imported here: it loads the agents SDK)
    if sessions is not None:
        sessions._memory = None


#: Debian's Chromium (apt-get install chromium), which Playwright drives: its own browser
#: downloads fail here.
CHROMIUM = "/usr/bin/chromium"
#: As root, and quiet on a closed network (headless, and a fresh profile, come from the
#: launch): without the background-networking flags Chromium keeps trying, and failing, to
#: reach Google's hosts.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing(message: str) -> None:
    """Skip the test for a part of the machine that is absent; fail it under CI's
    ``KIT_REQUIRE_SERVICES=1``."""
    if os.environ.get("KIT_REQUIRE_SERVICES") == "1":
        pytest.fail(message + "; KIT_REQUIRE_SERVICES=1 makes this a failure")
    pytest.skip(message)


def _service(name: str, port: int) -> None:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError as exc:
        missing(f"{name} is not running on 127.0.0.1:{port} ({exc})")


@pytest.fixture
def redis_url():
    """The machine's Redis (database 15, which the tests own)."""
    _service("Redis", 6379)
    return "redis://127.0.0.1:6379/15"


#: The machine's PostgreSQL (trust auth); each test gets a schema of its own in database ``test``.
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture
def postgres_url():
    """A ``KIT_STORE`` URL on the machine's PostgreSQL, in a fresh schema dropped after the test
    (so runs never see each other)."""
    _service("PostgreSQL", 5432)
    try:
        import psycopg
    except ImportError as exc:
        missing(f"psycopg is not installed ({exc}): pip install -e '.[test,postgres]'")
    schema = f"test_{uuid.uuid4().hex[:16]}"
    yield f"{POSTGRES}?schema={schema}"
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def shared_url(request, tmp_path):
    """A store URL that several processes (or store objects, or decks) share: a SQLite file or
    a Postgres schema. SQLite's followers hear other processes through a poll, Postgres's
    through NOTIFY."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path / 'kit.db'}"


@pytest.fixture
async def store(tmp_path, anyio_backend):
    """An open SQLite event store in a fresh file (test files may override it)."""
    async with SQLiteStore(tmp_path / "kit.db") as s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium driven by Playwright, with a fresh profile: one per test module
    (each test opens its own page)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        missing(f"Playwright is not installed ({exc}): pip install -e '.[test]'")
    if not os.access(CHROMIUM, os.X_OK):
        missing(f"Chromium is not at {CHROMIUM}: apt-get install chromium")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900})
        try:
            yield context
        finally:
            context.close()
