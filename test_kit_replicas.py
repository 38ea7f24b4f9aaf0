"""Scale-out: three real kit-serve processes on one PostgreSQL schema and one Redis, driven
round-robin over HTTP (README "Scale out"). Any replica serves any request: session claims,
pending workflows and their answers, control requests, the live tail of another replica's run,
and the record of a replica that died (asyncio and trio workers). And a replica's conversations,
on Postgres (beside its log) or on Redis, outlive the server dropping their connections."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import anyio
import httpx
import pytest
import redis
from httpx_sse import aconnect_sse

import kit
from kit_pg import store_from_url
from kit_pgpool import pg_url
from test_kit_http import free_port
from test_kit_store import kill_connections

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent
#: A lapsed lease is reaped by a survivor within about this (renewals every third of it).
LEASE = 1.5

PAUSING = '''
import asyncio
import kit

async def pause(seconds: float) -> str:
    """Wait a while."""
    await asyncio.sleep(seconds)
    return "waited"

agent = kit.Agent({name!r}, tools=[pause], model=kit.ScriptedModel(
    [{{"tool": "pause", "args": {{"seconds": {seconds}}}}}, {reply!r}], cycle=True))
'''
TALK = '''
import kit

agent = kit.Agent("talk", model=kit.ScriptedModel(["Hello.", "Still here."], cycle=True))
'''
APPROVAL = '''
import operator
from typing import Annotated, TypedDict
from langgraph.graph import END, START, StateGraph
import kit

class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]

async def ask(state: State) -> dict:
    answer = kit.interrupt({"question": "approve?"})
    return {"log": [f"answer={answer}"]}

g = StateGraph(State)
g.add_node("ask", ask)
g.add_edge(START, "ask")
g.add_edge("ask", END)
workflow = kit.Workflow("approval", g, durable=True)
'''


def project(root: Path) -> Path:
    for kind, name, source in (("agents", "chat", PAUSING.format(name="chat", seconds=2, reply="done waiting")),
                               ("agents", "slow", PAUSING.format(name="slow", seconds=60, reply="never")),
                               ("agents", "talk", TALK), ("workflows", "approval", APPROVAL)):
        path = root / kind / name / ("agent.py" if kind == "agents" else "workflow.py")
        path.parent.mkdir(parents=True)
        path.write_text(source)
    return root


def replica(root: Path, store: str, session: str, worker: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE=store, KIT_SESSION=session,
               KIT_LEASE_SECONDS=str(LEASE), KIT_WORKER=worker, PORT=str(port), HOST="127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "kit_serve"], cwd=HERE, env=env,
                            stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def healthy(client: httpx.AsyncClient, proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"{base} did not start"
        try:
            if (await client.get(f"{base}/health", timeout=1)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await anyio.sleep(0.1)


async def frames(client: httpx.AsyncClient, url: str, into: list[dict], **kw) -> None:
    """Every SSE frame of ``url`` (the native log route: ``event: <kind>``), in order."""
    async with aconnect_sse(client, "GET", url, **kw) as source:
        if source.response.status_code != 200:  # say what the replica answered instead
            raise AssertionError(f"{url}: {source.response.status_code} "
                                 f"{(await source.response.aread())[:500]!r}")
        async for sse in source.aiter_sse():
            into.append({"kind": sse.event, **json.loads(sse.data)})


async def test_three_replicas_on_one_postgres_and_one_redis(tmp_path, postgres_url, redis_url,
                                                            anyio_backend):
    root = project(tmp_path / "proj")  # the replicas' worker is the test's backend
    procs = [replica(root, postgres_url, redis_url, anyio_backend) for _ in range(3)]
    (pa, a), (_, b), (_, c) = procs
    tag = uuid.uuid4().hex[:8]  # sessions of this test only (Redis is shared)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            with anyio.fail_after(120):
                for proc, base in procs:
                    await healthy(client, proc, base)
                await one_turn_per_session_and_a_live_tail(client, a, b, c, tag)
                await cancel_from_another_replica(client, a, b, c, tag)
                await workflow_parked_on_one_answered_on_another(client, a, b, c, tag)
                await a_dead_replica_is_reaped_by_a_survivor(client, pa, a, b, c, tag, redis_url)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def started_on(client: httpx.AsyncClient, base: str, agent: str, session: str,
                     message: str = "go") -> tuple[str, object]:
    """Start a streamed turn on ``base``: its run id (the start, with its claim, is committed
    before the headers), and the response to read on or close."""
    request = client.build_request("POST", f"{base}/agents/{agent}/chat?stream=true",
                                   json={"session_id": session, "message": message})
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    return response.headers["x-kit-run-id"], response


async def one_turn_per_session_and_a_live_tail(client, a, b, c, tag) -> None:
    run_id, stream_a = await started_on(client, a, "chat", f"s1-{tag}")
    busy = await client.post(f"{b}/agents/chat/chat", json={"session_id": f"s1-{tag}", "message": "me too"})
    assert busy.status_code == 409 and busy.json()["error"] == "SessionBusyError"
    tail: list[dict] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(frames, client, f"{c}/runs/{run_id}/events", tail)
        while not any(f["kind"] == "tool.started" for f in tail):
            await anyio.sleep(0.02)
        assert tail[-1]["kind"] != "run.completed"  # live: the run on A is still playing
        body = (await stream_a.aread()).decode()
        await stream_a.aclose()
    assert "event: done" in body
    assert [f["seq"] for f in tail] == list(range(len(tail)))
    assert tail[0]["kind"] == "run.started" and tail[-1]["kind"] == "run.completed"
    assert tail[-1]["payload"]["output"] == "done waiting"


async def cancel_from_another_replica(client, a, b, c, tag) -> None:
    run_id, stream_a = await started_on(client, a, "chat", f"s2-{tag}")
    tail: list[dict] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(frames, client, f"{c}/runs/{run_id}/events", tail)
        while not any(f["kind"] == "tool.started" for f in tail):
            await anyio.sleep(0.02)
        asked = await client.post(f"{b}/runs/{run_id}/cancel", json={"reason": "from b"})
        assert asked.status_code == 202
        await stream_a.aread()
        await stream_a.aclose()
    kinds = [f["kind"] for f in tail]
    # The tool finished; the next model call (the safe point) did not happen.
    assert kinds[-3:] == ["tool.completed", "control.requested", "run.cancelled"]
    assert tail[-1]["payload"]["reason"] == "from b" and "message.completed" not in kinds
    assert (await client.post(f"{c}/runs/{run_id}/cancel", json={})).status_code == 409


async def workflow_parked_on_one_answered_on_another(client, a, b, c, tag) -> None:
    parked = (await client.post(f"{a}/workflows/approval",
                                json={"input": {"log": []}, "thread_id": f"t1-{tag}"})).json()
    assert parked["type"] == "interrupt"
    pending = (await client.get(f"{c}/workflows/pending")).json()["pending"]
    assert parked["run_id"] in [p["run_id"] for p in pending]
    answered = await client.post(f"{b}/workflows/approval/t1-{tag}/resume", json={"value": "yes"})
    assert answered.status_code == 200 and answered.json()["output"]["log"] == ["answer=yes"]
    again = await client.post(f"{c}/workflows/approval/t1-{tag}/resume", json={"value": "twice"})
    assert again.status_code == 404  # answered once
    log: list[dict] = []
    await frames(client, f"{a}/runs/{parked['run_id']}/events", log)
    assert [f["kind"] for f in log].count("run.resumed") == 1 and log[-1]["kind"] == "run.completed"


async def a_dead_replica_is_reaped_by_a_survivor(client, pa, a, b, c, tag, redis_url) -> None:
    said = await client.post(f"{a}/agents/talk/chat", json={"session_id": f"s5-{tag}", "message": "I am Ana"})
    assert said.status_code == 200
    parked = (await client.post(f"{a}/workflows/approval",
                                json={"input": {"log": []}, "thread_id": f"t2-{tag}"})).json()
    run_id, stream_a = await started_on(client, a, "slow", f"s4-{tag}")
    seen: list[dict] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(frames, client, f"{b}/runs/{run_id}/events", seen)
        while not any(f["kind"] == "tool.started" for f in seen):
            await anyio.sleep(0.02)
        pa.kill()  # SIGKILL: no goodbye, its lease just stops being renewed
        pa.wait(10)
        await stream_a.aclose()
    # B's follow of the dead replica's run ended with the survivor's record of it.
    assert seen[-1]["kind"] == "run.failed" and seen[-1]["payload"]["error"] == "RunAbandoned"
    free = await client.post(f"{c}/agents/talk/chat", json={"session_id": f"s4-{tag}", "message": "hi"})
    assert free.status_code == 200  # the session is free again
    pending = (await client.get(f"{b}/workflows/pending")).json()["pending"]
    assert parked["run_id"] in [p["run_id"] for p in pending]  # parked runs are left alone
    answered = await client.post(f"{c}/workflows/approval/t2-{tag}/resume", json={"value": "late"})
    assert answered.json()["output"]["log"] == ["answer=late"]
    # The conversation goes on on B with its history (Redis): the model saw the first turn.
    went_on = await client.post(f"{b}/agents/talk/chat?stream=true",
                                json={"session_id": f"s5-{tag}", "message": "Who am I?"})
    before: list[dict] = []
    log: list[dict] = []
    await frames(client, f"{b}/runs/{said.headers['x-kit-run-id']}/events", before)
    await frames(client, f"{b}/runs/{went_on.headers['x-kit-run-id']}/events", log)
    r = redis.Redis.from_url(redis_url)
    try:
        stored = [json.loads(x) for x in r.lrange(f"kit:session:s5-{tag}:messages", 0, -1)]
        for key in r.scan_iter(f"kit:session:*{tag}*"):
            r.delete(key)
    finally:
        r.close()
    assert [i.get("role") for i in stored] == ["user", "assistant", "user", "assistant"]
    assert "I am Ana" in json.dumps(stored[0])
    tokens = [[f["payload"]["input_tokens"] for f in run if f["kind"] == "model.completed"]
              for run in (before, log)]
    assert tokens[1][0] > tokens[0][0] + 2  # "Who am I?" came with the turn before it


async def test_postgres_sessions_outlive_the_server_dropping_their_connections(
        monkeypatch, postgres_url, anyio_backend):
    """KIT_SESSION=postgresql:// beside a Postgres log: once the server has dropped the session
    store's idle connections (a restart, a failover, an idle timeout), the next turn goes on
    with the conversation's history, not a FAILED run and an OperationalError."""
    import psycopg
    monkeypatch.setenv("KIT_SESSION", postgres_url)
    model = kit.ScriptedModel(["Hi Ana.", "You are Ana."])
    async with store_from_url(postgres_url) as store, \
            kit.Deck([kit.Agent("talk", model=model)], store=store) as deck:
        with anyio.fail_after(30):
            await deck.run("talk", "I am Ana", session_id="conv")
            # Only this deck's session connections (named kit-session:<this test's schema>).
            assert await anyio.to_thread.run_sync(kill_connections, postgres_url, "kit-session")
            answer = await deck.run("talk", "Who am I?", session_id="conv")
        assert answer.output == "You are Ana."
        assert [r.status for r in await store.runs()] == [kit.RunStatus.COMPLETED] * 2
    said = [(i.get("role"), json.dumps(i.get("content"))) for i in model.calls[-1]["input"]]
    assert [role for role, _ in said] == ["user", "assistant", "user"]  # turn 1, then the input
    assert "I am Ana" in said[0][1] and "Hi Ana." in said[1][1]
    conninfo, schema = pg_url(postgres_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:  # both turns are in the session
        rows = conn.execute(f"SELECT message_data FROM {schema}.agent_messages WHERE session_id "
                            "= 'conv' ORDER BY id").fetchall()
    assert [json.loads(data).get("role") for (data,) in rows] == ["user", "assistant"] * 2


# asyncio only: the test reads the SDK's engine itself, which under trio lives on the deck's
# engine thread.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_postgres_sessions_keep_the_options_their_url_gives(monkeypatch, postgres_url,
                                                                  anyio_backend):
    """KIT_SESSION=postgresql://...?options=-c ...: the session store's own connection options
    (its schema's search_path) replaced the URL's, so a setting such as synchronous_commit was
    silently dropped."""
    monkeypatch.setenv("KIT_SESSION", postgres_url + "&options=-c%20synchronous_commit%3Doff")
    model = kit.ScriptedModel(["ok"])
    async with store_from_url(postgres_url) as store, \
            kit.Deck([kit.Agent("talk", model=model)], store=store) as deck:
        assert (await deck.run("talk", "hi", session_id="conv")).output == "ok"
        engine = deck._runtime.sessions._engine  # the connections the SDK's session uses
        async with engine.connect() as conn:
            setting = (await conn.exec_driver_sql("SHOW synchronous_commit")).scalar()
            path = (await conn.exec_driver_sql("SHOW search_path")).scalar()
    assert setting == "off" and path == pg_url(postgres_url)[1]


def kill_redis_clients(url: str, name: str) -> int:
    """Close the Redis server's connections of the clients named ``name`` (``CLIENT KILL ID``,
    one by one: other tests share the server); how many there were."""
    r = redis.Redis.from_url(url)
    try:
        return sum(r.client_kill_filter(_id=c["id"]) for c in r.client_list()
                   if c["name"] == name)
    finally:
        r.close()


async def test_a_redis_that_stops_answering_fails_the_turn_and_frees_its_session(
        monkeypatch, store, anyio_backend, tmp_path):
    """A Redis that stops answering without closing its connections (a partition, a frozen
    server; here SIGSTOP, of a redis-server of this test's own) held the turn, and its session
    busy, until it came back."""
    import kit_sessions
    from conftest import missing
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly",
                               "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        with anyio.fail_after(10):
            while True:
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    await anyio.sleep(0.05)
        client.close()
        monkeypatch.setenv("KIT_SESSION", url)
        monkeypatch.setattr(kit_sessions, "REDIS_TIMEOUT", 0.5)
        model = kit.ScriptedModel(["one", "two"])
        async with kit.Deck([kit.Agent("talk", model=model)], store=store) as deck:
            with anyio.fail_after(30):
                await deck.run("talk", "first", session_id="c")
                server.send_signal(signal.SIGSTOP)
                with pytest.raises(Exception, match="(?i)timeout"):
                    await deck.run("talk", "second", session_id="c")
                server.send_signal(signal.SIGCONT)
                assert (await deck.run("talk", "third", session_id="c")).output == "two"
            assert [r.status for r in await store.runs()] == [
                kit.RunStatus.COMPLETED, kit.RunStatus.FAILED, kit.RunStatus.COMPLETED]
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()


class FreezingProxy:
    """A TCP proxy in front of the machine's Postgres that, while ``frozen``, stops answering
    without closing a connection (a partition, a frozen server): what it holds stays held, and a
    new connection is accepted and never answered. A thread of its own."""

    def __init__(self) -> None:
        self.frozen = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listening socket was closed: done
            while True:
                client = self.server.accept()[0]
                self.held.append(client)
                if not self.frozen.is_set():
                    upstream = socket.create_connection(("127.0.0.1", 5432))
                    self.held.append(upstream)
                    for a, b in ((client, upstream), (upstream, client)):
                        threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.02)
                b.sendall(data)

    def close(self) -> None:
        self.frozen.clear()
        self.server.close()
        for conn in self.held:
            conn.close()


async def test_a_postgres_that_stops_answering_fails_the_turn_and_frees_its_session(
        monkeypatch, store, postgres_url, anyio_backend):
    """KIT_SESSION=postgresql://: a server that stops answering without closing its connections
    (here a proxy that holds every byte) held the turn, and its session busy, until it came
    back: SQLAlchemy and psycopg wait forever, as redis-py did before REDIS_TIMEOUT."""
    import kit_sessions
    proxy = FreezingProxy()
    try:
        monkeypatch.setenv("KIT_SESSION", postgres_url.replace("127.0.0.1:5432",
                                                               f"127.0.0.1:{proxy.port}"))
        monkeypatch.setattr(kit_sessions, "PG_TIMEOUT", 0.5)
        model = kit.ScriptedModel(["one", "two"])
        async with kit.Deck([kit.Agent("talk", model=model)], store=store) as deck:
            with anyio.fail_after(30):
                await deck.run("talk", "first", session_id="c")
                proxy.frozen.set()
                with pytest.raises(TimeoutError, match="KIT_SESSION=.* did not answer"):
                    await deck.run("talk", "second", session_id="c")
                proxy.frozen.clear()
                assert (await deck.run("talk", "third", session_id="c")).output == "two"
            assert [r.status for r in await store.runs()] == [
                kit.RunStatus.COMPLETED, kit.RunStatus.FAILED, kit.RunStatus.COMPLETED]
    finally:
        proxy.close()


async def test_redis_sessions_outlive_the_server_dropping_their_connections(
        monkeypatch, store, redis_url, anyio_backend):
    """KIT_SESSION=redis://: once the server has dropped the session store's idle connections (a
    restart, a failover, an idle timeout), the next turn goes on with the conversation's
    history, not a FAILED run and "Connection closed by server"."""
    import kit_sessions
    tag = uuid.uuid4().hex[:8]
    name, conv = f"kit-session-{tag}", f"conv-{tag}"  # this test's connections and keys only
    monkeypatch.setenv("KIT_SESSION", f"{redis_url}?client_name={name}")
    model = kit.ScriptedModel(["Hi Ana.", "Noted.", "You are Ana."])
    r = redis.Redis.from_url(redis_url)
    try:
        async with kit.Deck([kit.Agent("talk", model=model)], store=store) as deck:
            with anyio.fail_after(30):
                await deck.run("talk", "I am Ana", session_id=conv)
                # Dropped right after a turn: within REDIS_CHECK of its last use no ping checks
                # the connection, and the next turn failed (the server had closed it).
                assert await anyio.to_thread.run_sync(kill_redis_clients, redis_url, name)
                await anyio.sleep(0.05)
                await deck.run("talk", "I like tea", session_id=conv)
                assert await anyio.to_thread.run_sync(kill_redis_clients, redis_url, name)
                # Idle past the check: a restart or a failover comes between turns, not in one.
                await anyio.sleep(kit_sessions.REDIS_CHECK + 0.1)
                answer = await deck.run("talk", "Who am I?", session_id=conv)
            assert answer.output == "You are Ana."
            assert [run.status for run in await store.runs()] == [kit.RunStatus.COMPLETED] * 3
        stored = [json.loads(x) for x in r.lrange(f"kit:session:{conv}:messages", 0, -1)]
    finally:
        for key in r.scan_iter(f"kit:session:{conv}*"):
            r.delete(key)
        r.close()
    said = [(i.get("role"), json.dumps(i.get("content"))) for i in model.calls[-1]["input"]]
    assert [role for role, _ in said] == ["user", "assistant"] * 2 + ["user"]  # turns 1-2, the input
    assert "I am Ana" in said[0][1] and "Hi Ana." in said[1][1]
    # Every turn is in the session, each once: nothing was written twice.
    assert [i.get("role") for i in stored] == ["user", "assistant"] * 3
