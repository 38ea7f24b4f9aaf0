"""Tests of browser safety (kit_guard, applied at the top of kit_http's dispatch): the Host
allowlist against DNS rebinding, the Origin check against cross-site requests, CORS answers for
listed origins only; and that a client that sends no Origin (curl, SDKs, v1) sees every route as
before. A real Hypercorn on loopback, httpx as the client."""
from __future__ import annotations

import json
import logging

import anyio
import pytest

import kit_http
from kit import ConfigError, RunStatus
from kit_guard import ANY_HOST, Guard
from test_kit_http import catalog, served, wire

pytestmark = pytest.mark.anyio
EVIL = "http://evil.example"
FRONT = "http://localhost:3000"


# ---------------------------------------------------------------------------- the policy ----

def test_default_hosts_follow_the_bound_address():
    assert Guard.from_env({}).hosts == ("localhost", "127.0.0.1", "[::1]")
    assert Guard.from_env({}, bind="0.0.0.0").hosts == ("localhost", "127.0.0.1", "[::1]")
    assert Guard.from_env({}, bind="::").hosts == ("localhost", "127.0.0.1", "[::1]")
    assert Guard.from_env({}, bind="127.0.0.2").hosts[-1] == "127.0.0.2"
    assert Guard.from_env({}, bind="::1").hosts == ("localhost", "127.0.0.1", "[::1]")
    listed = Guard.from_env({"KIT_ALLOWED_HOSTS": "Kit.Example., 10.0.0.5, 0:0::1"}, bind="0.0.0.0")
    assert listed.hosts == ("kit.example", "10.0.0.5", "[::1]") and not listed.any_host
    assert Guard.from_env({"KIT_ALLOWED_HOSTS": "*"}).any_host
    assert "answering Host localhost, 127.0.0.1, [::1]" in Guard().describe()


def test_a_bad_bind_address_is_named_as_the_address_not_as_a_setting_never_set():
    """``kit-serve --host "no such host"`` was refused as "KIT_ALLOWED_HOSTS lists host names",
    a setting the user never set."""
    with pytest.raises(ConfigError, match=r"^the address to bind \(--host or HOST\) is a host "
                                          r"name or address, got 'no such host'$"):
        Guard.from_env({}, bind="no such host")


def test_origins_are_normalised_and_bad_settings_are_config_errors():
    guard = Guard.from_env({"KIT_CORS_ORIGINS": "http://localhost:3000/, HTTPS://App.Example:443"})
    assert guard.origins == {"http://localhost:3000", "https://app.example"}
    assert guard.allows_origin("https://app.example") and not guard.allows_origin("https://app.example:8443")
    for env in ({"KIT_ALLOWED_HOSTS": "http://kit.example"}, {"KIT_ALLOWED_HOSTS": "a b"},
                {"KIT_ALLOWED_HOSTS": " , "},  # answered no Host: every request a 421
                {"KIT_CORS_ORIGINS": "kit.example"}, {"KIT_CORS_ORIGINS": "http://x/path"},
                {"KIT_CORS_ORIGINS": "ftp://x"}, {"KIT_CORS_ORIGINS": "null"}):
        with pytest.raises(ConfigError, match=next(iter(env))):
            Guard.from_env(env)
    # One name, not a list: it answered for the hosts l, o, c, a, h, s, t (every request a 421).
    for kw in ({"allowed_hosts": "localhost"}, {"cors_origins": "https://app.example"}):
        with pytest.raises(ConfigError, match=f"Guard\\({next(iter(kw))}=...\\) takes a list"):
            Guard(**kw)
    assert Guard(allowed_hosts=ANY_HOST).any_host and Guard(allowed_hosts=[ANY_HOST]).any_host


def test_kit_serve_refuses_a_malformed_setting(monkeypatch, capsys):
    # main() sets up kit-serve's console on this process's loggers, bound to capsys's stderr,
    # which is closed after the test: undone after it, so later tests' log lines do not fail.
    for name in ("", "kit_http", "kit_mcp", "kit_serve"):
        logger = logging.getLogger(name)
        for attribute in ("propagate", "level"):
            monkeypatch.setattr(logger, attribute, getattr(logger, attribute))
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setenv("KIT_CORS_ORIGINS", "localhost:3000")
    assert kit_http.main(["--port", "1"]) == 1
    assert "KIT_CORS_ORIGINS lists origins" in capsys.readouterr().err


# ------------------------------------------------------------------------------ over HTTP ----

async def test_a_rebinding_host_is_421_and_loopback_names_pass():
    async with served(catalog()) as (client, _):
        port = client.base_url.port
        r = await client.get("/workflows/pending", headers={"host": f"attacker.example:{port}"})
        assert (r.status_code, r.json()["error"]) == (421, "HostNotAllowedError")
        assert "does not answer for Host 'attacker.example:" in r.json()["message"]
        assert "KIT_ALLOWED_HOSTS" in r.json()["message"]
        r = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t"},
                              headers={"host": "attacker.example"})
        assert r.status_code == 421 and "x-kit-run-id" not in r.headers
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert (await client.get("/workflows/pending", headers={"host": host})).status_code == 200
        assert (await client.get("/workflows/pending")).json() == {"pending": []}  # nothing ran


async def test_an_absolute_form_target_is_routed_and_its_host_is_the_one_checked():
    """RFC 9112 3.2.2: a server must take ``GET http://host/path``; its authority, not the Host
    header, is the host asked for (so it is the one the rebinding check reads)."""
    async with served(catalog()) as (client, _):
        port = client.base_url.port

        async def raw(target: str) -> bytes:
            async with await anyio.connect_tcp("127.0.0.1", port) as conn:
                await conn.send(f"GET {target} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                                "connection: close\r\n\r\n".encode())
                reply = b""
                with anyio.fail_after(5):
                    while chunk := await conn.receive():
                        reply += chunk
                        if reply.endswith(b"}"):
                            return reply
            return reply

        ok = await raw(f"http://127.0.0.1:{port}/workflows/pending?x=1")
        assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b'{"pending":[]}'), ok
        assert (await raw(f"http://attacker.example:{port}/health")).startswith(b"HTTP/1.1 421")


async def test_a_cross_site_request_is_403_before_anything_runs():
    async with served(catalog()) as (client, app):
        parked = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t1"})
        run_id = parked.json()["run_id"]
        # A bodiless cross-site POST needs no preflight: the check itself must refuse it.
        r = await client.post(f"/runs/{run_id}/cancel", headers={"origin": EVIL})
        assert (r.status_code, r.json()["error"]) == (403, "OriginNotAllowedError")
        assert "access-control-allow-origin" not in r.headers
        assert await app.deck.status(run_id) is RunStatus.WAITING_HUMAN
        for origin in ("null", f"http://127.0.0.1:{client.base_url.port + 1}", f"https://127.0.0.1:{client.base_url.port}"):
            r = await client.post("/agents/echo/chat", json={"message": "hi"}, headers={"origin": origin})
            assert r.status_code == 403, origin
        assert await app.deck.store.runs(name="echo") == []
        r = await client.get("/health", headers={"origin": EVIL})  # reads are refused too
        assert r.status_code == 403
        # The server's own pages (the playground) are same-origin.
        same = f"http://127.0.0.1:{client.base_url.port}"
        r = await client.post("/agents/echo/chat", json={"message": "hi"}, headers={"origin": same})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_listed_origins_get_cors_answers_and_a_preflight():
    async with served(catalog(), guard=Guard(cors_origins=[FRONT])) as (client, _):
        r = await client.options("/agents/echo/chat", headers={
            "origin": FRONT, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert (r.status_code, r.content) == (204, b"") and "content-length" not in r.headers
        assert r.headers["access-control-allow-origin"] == FRONT
        assert r.headers["access-control-allow-methods"] == "GET, POST"
        assert r.headers["access-control-allow-headers"] == (  # a page can name a conversation
            "content-type, last-event-id, x-kit-session-id, mcp-protocol-version")
        assert r.headers["access-control-max-age"] == "600" and r.headers["vary"] == "origin"
        # The headers a client of its own sends are allowed too: an OpenAI client in a browser
        # always sends authorization and x-stainless-* (the browser refuses it otherwise).
        r = await client.options("/v1/chat/completions", headers={
            "origin": FRONT, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type,x-stainless-lang"})
        assert r.status_code == 204 and r.headers["access-control-allow-headers"] == (
            "content-type, last-event-id, x-kit-session-id, mcp-protocol-version, authorization, "
            "x-stainless-lang")
        r = await client.post("/agents/echo/chat", json={"message": "hi"}, headers={"origin": FRONT})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == FRONT
        assert r.headers["access-control-expose-headers"] == "x-kit-run-id, x-should-retry"
        run_id = r.headers["x-kit-run-id"]
        r, body = await wire(client, "GET", f"/runs/{run_id}/events", headers={"origin": FRONT})
        assert r.headers["access-control-allow-origin"] == FRONT and body.endswith(b"}\n\n")
        r = await client.get("/nowhere", headers={"origin": FRONT})  # errors are readable too
        assert r.status_code == 404 and r.headers["access-control-allow-origin"] == FRONT
        # Not for anyone else: an unlisted preflight is refused, a preflight without Origin is
        # an OPTIONS like any other (405, as before).
        r = await client.options("/agents/echo/chat", headers={
            "origin": EVIL, "access-control-request-method": "POST"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = await client.options("/agents/echo/chat", headers={"access-control-request-method": "POST"})
        assert (r.status_code, r.headers["allow"]) == (405, "POST")


async def test_a_v1_client_without_origin_gets_every_route_as_before():
    async with served(catalog()) as (client, app):
        def plain(r) -> bool:
            return not any(k.startswith("access-control-") for k in r.headers)

        answers = [await client.get("/health"), await client.get("/workflows/pending")]
        chat = await client.post("/agents/echo/chat", json={"message": "hi", "session_id": "s"})
        answers += [chat, await client.post("/workflows/plain", json={"input": {}})]
        r, body = await wire(client, "POST", "/agents/echo/chat?stream=true", json={"message": "hi"})
        answers.append(r)
        assert body.startswith(b'id: 1\ndata: {"delta":"hello"}\n\n')
        r, body = await wire(client, "POST", "/workflows/approve?stream=true",
                             json={"input": {}, "thread_id": "t"})
        answers.append(r)
        assert b"event: interrupt" in body
        answers.append(await client.post("/workflows/approve/t/resume", json={"value": "yes"}))
        events, body = await wire(client, "GET", f"/runs/{chat.headers['x-kit-run-id']}/events")
        answers.append(events)
        assert [json.loads(line[6:])["kind"] for line in body.split(b"\n") if line.startswith(b"data: ")][-1] \
            == "run.completed"
        parked = await client.post("/workflows/approve", json={"input": {}, "thread_id": "t2"})
        run_id = parked.json()["run_id"]
        answers.append(await client.post(f"/runs/{run_id}/pause", json={}))
        answers.append(await client.post(f"/runs/{run_id}/cancel"))
        with anyio.fail_after(5):
            while await app.deck.status(run_id) is not RunStatus.CANCELLED:
                await anyio.sleep(0.01)
        answers.append(await client.post(f"/runs/{run_id}/resume"))
        # A parked run takes no pause (409, issue 12: a request that cannot act says so).
        assert [r.status_code for r in answers] == [200, 200, 200, 200, 200, 200, 200, 200, 409, 202, 409]
        assert all(plain(r) for r in answers)
        assert answers[-3].json()["error"] == "ControlRefusedError"
