"""Tests of MCP tool servers: .mcp.json parsing, real servers over stdio (mcp-server-time from
PyPI), streamable HTTP and SSE (FastMCP on loopback), their tools in the log, and the lifecycle:
build() starts nothing, aclose() leaves no child process, nor a helper a server spawned; a
server that dies or hangs is named and restarted once, one that cannot restart fails every
later turn at once (asyncio and trio)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from agents.mcp import MCPServerSse, MCPServerStdio, MCPServerStreamableHttp

import kit
import kit_mcp_servers
from kit import MCP, Agent, ConfigError, Deck, ScriptedModel
from kit_store import MemoryStore

pytestmark = [
    pytest.mark.anyio,
    # openai-agents 0.17's MCPServerStreamableHttp still calls mcp's deprecated
    # streamablehttp_client (mcp 1.30); not kit's to fix.
    pytest.mark.filterwarnings("ignore:Use `streamable_http_client` instead:DeprecationWarning"),
]

TIME = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}

SERVER = '''
import sys
from mcp.server.fastmcp import FastMCP

mcp = FastMCP("local", host="127.0.0.1", port=int(sys.argv[1]), log_level="WARNING")


@mcp.tool()
def get_current_time(timezone: str) -> str:
    """The time on the local test clock (the same tool name as mcp-server-time's)."""
    return f"test clock: 12:00 in {timezone}"


@mcp.tool()
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper() + "!"


@mcp.tool()
def refuse(text: str) -> str:
    """Fail (the server answers with an isError result)."""
    raise ValueError(f"refused: {text}")


@mcp.tool()
async def slow(seconds: float) -> str:
    """Take a while."""
    import anyio
    await anyio.sleep(seconds)
    return "finally"


mcp.run(transport=sys.argv[2])
'''


FAULTY = '''
import os, subprocess, sys, time
from pathlib import Path
from mcp.server.fastmcp import FastMCP

here = Path(sys.argv[1])
with open(here / "starts", "a") as f:  # one line per start: the deck's restarts, counted
    f.write(f"{os.getpid()}\\n")
if (here / "broken").exists():  # a server that can no longer start
    sys.exit(3)
mcp = FastMCP("faulty", log_level="WARNING")


@mcp.tool()
def echo(text: str) -> str:
    """Echo the text, with this server's process id."""
    return f"{text} from {os.getpid()}"


@mcp.tool()
def crash(code: int, for_good: bool = False) -> str:
    """Die in the middle of the call (for good: no later start succeeds either)."""
    if for_good:
        (here / "broken").touch()
    os._exit(code)


@mcp.tool()
def hang() -> str:
    """Hold the server past any timeout (a sync tool blocks its event loop: list_tools too)."""
    time.sleep(3600)
    return "never"


@mcp.tool()
def spawn() -> int:
    """Start a helper process, which outlives this server unless its process group is ended."""
    return subprocess.Popen(["sleep", "300"]).pid


mcp.run("stdio")
'''


def faulty(tmp_path: Path, timeout: float = 20) -> dict:
    """The config of the FAULTY stdio server, writing its starts to ``tmp_path / "starts"``."""
    script = tmp_path / "faulty.py"
    script.write_text(textwrap.dedent(FAULTY))
    return {"command": sys.executable, "args": [str(script), str(tmp_path)], "timeout": timeout}


def starts(tmp_path: Path) -> list[int]:
    path = tmp_path / "starts"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def gone(pid: int, within: float = 10) -> bool:
    with anyio.move_on_after(within):
        while alive(pid):
            await anyio.sleep(0.05)
    return not alive(pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children() -> set[int]:
    """Live (non-zombie) child processes of this process, read from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            found.add(int(entry))
    return found


@asynccontextmanager
async def fastmcp(tmp_path: Path, transport: str, port: int | None = None):
    """A FastMCP server in a subprocess on a loopback port (``port``, or a free one); yields its URL."""
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(SERVER))
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), transport],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with anyio.fail_after(20):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None, "the FastMCP server exited"
                    await anyio.sleep(0.05)
        yield f"http://127.0.0.1:{port}/" + ("sse" if transport == "sse" else "mcp")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
async def store():
    async with MemoryStore() as s:
        yield s


# ---------------------------------------------------------------------------- parsing ----

def test_mcp_json_formats_and_transports(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_T_TOKEN", "s3cret")
    monkeypatch.delenv("KIT_T_UNSET", raising=False)
    claude = {"mcpServers": {
        "time": {"command": "${KIT_T_PY:-python3}", "args": ["-m", "${env:KIT_T_TOKEN}"],
                 "env": {"TOKEN": "${KIT_T_TOKEN}", "MODE": "${KIT_T_UNSET:-dev}"}},
        "web": {"url": "https://example.test/${KIT_T_TOKEN}/mcp",
                "headers": {"Authorization": "Bearer ${KIT_T_TOKEN}"}, "timeout": 90},
        "legacy": {"type": "sse", "url": "http://127.0.0.1:1/sse"},
    }}
    (tmp_path / ".mcp.json").write_text(json.dumps(claude))
    mcp = MCP(tmp_path / ".mcp.json")
    time, web, legacy = mcp.servers["time"], mcp.servers["web"], mcp.servers["legacy"]
    assert (time["type"], time["command"], time["args"]) == ("stdio", "python3", ["-m", "s3cret"])
    assert time["env"] == {"TOKEN": "s3cret", "MODE": "dev"} and time["timeout"] == kit.MCP_TIMEOUT
    assert (web["type"], web["url"], web["timeout"]) == ("http", "https://example.test/s3cret/mcp", 90)
    assert web["headers"] == {"Authorization": "Bearer s3cret"}
    assert legacy["type"] == "sse"
    built = kit_mcp_servers.mcp_servers(mcp)  # objects only: nothing connects
    assert isinstance(built["time"], MCPServerStdio) and isinstance(built["legacy"], MCPServerSse)
    assert isinstance(built["web"], MCPServerStreamableHttp)
    assert built["web"].client_session_timeout_seconds == 90
    assert built["time"].client_session_timeout_seconds == kit.MCP_TIMEOUT > 5
    assert built["time"].params.env["TOKEN"] == "s3cret" and "PATH" in built["time"].params.env
    vscode = MCP({"servers": {"web": {"type": "http", "url": "http://127.0.0.1:1/mcp"},
                              "local": {"type": "stdio", "command": "srv"}}})
    assert [s["type"] for s in vscode.servers.values()] == ["http", "stdio"]
    assert MCP({"bare": {"command": "srv"}}).servers["bare"]["env"] is None
    bom = tmp_path / "bom.json"  # Notepad's BOM: it was "not valid JSON: Unexpected UTF-8 BOM"
    bom.write_bytes(b'\xef\xbb\xbf{"mcpServers": {"a": {"command": "x"}}}')
    assert list(MCP(bom).servers) == ["a"]


@pytest.mark.parametrize("config, match", [
    ({"mcpServers": {"a": {"command": "${KIT_T_UNSET}"}}}, "KIT_T_UNSET is not set"),
    ({"mcpServers": {"a": {"url": "http://h/${KIT_T_UNSET}"}}}, "KIT_T_UNSET is not set"),
    ({"mcpServers": {"a": {"command": "x", "args": ["${input:key}"]}}}, "asks for user input"),
    ({"mcpServers": {"a": {"command": "x"}}, "servers": {}}, "both 'mcpServers' and 'servers'"),
    ({"mcpServers": {"a": {"type": "ws", "url": "ws://h"}}}, "unknown type 'ws'"),
    ({"mcpServers": {"a": {"args": []}}}, "needs a 'command'"),
    ({"mcpServers": {"a": {"type": "sse", "url": "ftp://h"}}}, "http\\(s\\) 'url'"),
    ({"mcpServers": {"a": {"command": "x", "timeout": 0}}}, "timeout must be a positive"),
    ({"mcpServers": {"a": {"command": "x", "timeout": float("inf")}}}, "finite"),  # JSON Infinity
    ({"mcpServers": {"a": {"command": "x", "timeout": 10 ** 400}}}, "finite"),  # past a float
    ({"mcpServers": {"a": {"command": "x", "args": "one"}}}, "list of strings"),
    # The entry named (the server's start said "embedded null byte", "illegal ... name", or
    # only "env must be an object of strings" of an env of many keys), its value never quoted
    ({"mcpServers": {"a": {"command": "x", "env": {"K": "v", "PORT": 8080}}}},
     r"MCP server 'a': env\['PORT'\] must be a string, got int$"),
    ({"mcpServers": {"a": {"command": "x", "env": {"A=B": "v"}}}},
     "env 'A=B' is not an environment variable name"),
    ({"mcpServers": {"a": {"command": "x", "args": ["-c", "sk-live-SUPERSECRET\0"]}}},
     r"MCP server 'a': args\[1\] holds a NUL once expanded$"),
    # a command empty or with a NUL once expanded: the open said "Permission denied: ''" or
    # "embedded null byte"
    ({"mcpServers": {"a": {"command": "${KIT_T_UNSET:-}"}}},
     r"MCP server 'a': the command '\$\{KIT_T_UNSET:-\}' is empty once expanded$"),
    ({"mcpServers": {"a": {"command": "  "}}}, r"MCP server 'a': the command '  ' is empty"),
    ({"mcpServers": {"a": {"command": "srv\0--key=sk-live-SUPERSECRET"}}},
     r"MCP server 'a': the command holds a NUL once expanded$"),
    ({"mcpServers": {"a b": {"command": "x"}}}, "MCP server name"),
    ({"mcpServers": []}, "name -> config"),
    ({"mcpServers": {"a": {"type": ["stdio"], "command": "x"}}}, r"unknown type \['stdio'\]"),
])
def test_bad_mcp_configs_are_config_errors(monkeypatch, config, match):
    monkeypatch.delenv("KIT_T_UNSET", raising=False)
    with pytest.raises(ConfigError, match=match):
        MCP(config)


def test_an_mcp_error_quotes_the_config_as_written_not_the_secret_it_expands_to(monkeypatch):
    monkeypatch.setenv("KIT_T_KEY", "sk-live-SUPERSECRET")
    for url in ("${KIT_T_KEY}", "wss://h/?token=${KIT_T_KEY}"):
        with pytest.raises(ConfigError, match=re.escape(repr(url))) as err:
            MCP({"mcpServers": {"t": {"url": url}}})
        assert "SUPERSECRET" not in str(err.value)


@pytest.mark.parametrize("url, why", [
    ("http://${KIT_T_HOST}/mcp?key=${KIT_T_KEY}", "holds a line break or control character"),
    ("https:///mcp", "has no host"),
    ("http://${KIT_T_UNSET:-}/mcp", "has no host"),
    ("http://[::1/mcp", "has a malformed host or port"),
    ("http://127.0.0.1:99999/mcp", "has a malformed host or port"),
    ("http://docs example/mcp", "has a malformed host or port"),
])
def test_a_url_no_request_can_reach_is_a_config_error_quoting_it_as_written(monkeypatch, url, why):
    """A URL without a host, with a port past 65535, an unclosed IPv6 bracket, or a line break
    once expanded (a host read from a file keeps its newline) passed, and the deck's open
    failed as 'it closed the connection while connecting'; refused here, quoted as written."""
    monkeypatch.setenv("KIT_T_HOST", "docs.example\n")
    monkeypatch.delenv("KIT_T_UNSET", raising=False)
    monkeypatch.setenv("KIT_T_KEY", "sk-live-SUPERSECRET")
    with pytest.raises(ConfigError, match=f"MCP server 't': the url {re.escape(repr(url))} {why}"
                       ) as err:
        MCP({"t": {"url": url}})
    assert "SUPERSECRET" not in str(err.value)
    # a space in the path is the client's to escape, as it does: still a server it reaches
    assert MCP({"t": {"url": "http://h/a b"}}).servers["t"]["url"] == "http://h/a b"


def test_a_header_a_request_cannot_carry_is_a_config_error_that_never_quotes_its_value(monkeypatch):
    """A token read from a file keeps its trailing newline: refused here, naming the header (the
    open failed as 'it closed the connection while connecting'), never quoting the secret."""
    monkeypatch.setenv("KIT_T_KEY", "sk-live-SUPERSECRET\n")
    with pytest.raises(ConfigError, match="header 'Authorization' holds a line break") as err:
        MCP({"t": {"url": "http://h/mcp", "headers": {"Authorization": "Bearer ${KIT_T_KEY}"}}})
    assert "SUPERSECRET" not in str(err.value)
    with pytest.raises(ConfigError, match="'X Key' is not an HTTP header name"):
        MCP({"t": {"url": "http://h/mcp", "headers": {"X Key": "v"}}})
    assert MCP({"t": {"url": "http://h/mcp", "headers": {"X-Key": "v\tw"}}}).servers["t"]["headers"] == {
        "X-Key": "v\tw"}


def test_a_key_written_twice_in_the_mcp_json_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """A server pasted twice under one name was the last one alone, the first gone in silence;
    the error names the key, never a value (an env value may be a secret)."""
    monkeypatch.setenv("KIT_T_KEY", "sk-live-SUPERSECRET")
    file = tmp_path / ".mcp.json"
    file.write_text('{"mcpServers": {"time": {"command": "a"}, "time": {"command": "b"}}}')
    (tmp_path / "proj").mkdir()
    with pytest.raises(ConfigError, match=r"\.mcp\.json has the key 'time' twice") as err:
        Deck.from_project(tmp_path / "proj")
    assert str(file) in str(err.value)
    file.write_text('{"s": {"command": "x", "env": {"K": "${KIT_T_KEY}", "K": "sk-other"}}}')
    with pytest.raises(ConfigError, match="the key 'K' twice") as err:
        MCP(file)
    assert "SUPERSECRET" not in str(err.value) and "sk-other" not in str(err.value)


@pytest.mark.parametrize("names, what, twice", [
    ({"mcp_servers": ["time", "time"]}, "mcp_servers", "time"),
    ({"skills": ["notes", "review", "notes"]}, "skills", "notes"),
    ({"workflows": ["plan", "plan"]}, "workflows", "plan"),
])
def test_a_name_listed_twice_in_an_agents_lists_is_a_config_error(names, what, twice):
    """Agent(mcp_servers=["time", "time"]) built, and the SDK, given the server twice, renamed
    each of its tools (mcp_time__get_current_time_<hash>): a model calling the documented name
    failed the run with "Tool mcp_time__get_current_time not found in agent a"."""
    with pytest.raises(ConfigError, match=f"agent 'a': {what} names {twice!r} twice"):
        Agent("a", model=ScriptedModel(["x"]), **names)


def test_unreadable_files_and_unknown_names(tmp_path):
    bad = tmp_path / ".mcp.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        Deck(mcp=bad)
    assert str(bad) in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        MCP(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="nested too deeply") as err:
        bad.write_text("[" * 100_000 + "]" * 100_000)
        MCP(bad)
    assert str(bad) in str(err.value)
    with pytest.raises(ConfigError, match=r"^MCP config .*/fifo.json is not a regular file"):
        os.mkfifo(tmp_path / "fifo.json")  # its read would wait for a writer for ever
        MCP(tmp_path / "fifo.json")
    with pytest.raises(ConfigError, match=r"/\.mcp\.json: MCP server name must be .* got 'a b'"):
        bad.write_text('{"mcpServers": {"a b": {"command": "x"}}}')
        MCP(bad)
    deck = Deck([Agent("a", mcp_servers=["time", "nope"])], mcp=MCP({"time": TIME}))
    with pytest.raises(ConfigError, match=r"unknown MCP server 'nope' \(the deck has: time\)"):
        deck.build()
    anyio.run(deck.aclose)


# ------------------------------------------------------------------------ real servers ----

async def test_tools_of_stdio_and_http_servers_reach_the_model_and_the_log(tmp_path, store):
    async with fastmcp(tmp_path, "streamable-http") as url:
        model = ScriptedModel([
            {"tool": "mcp_time__get_current_time", "args": {"timezone": "UTC"}},
            [{"tool": "mcp_local__get_current_time", "args": {"timezone": "UTC"}},
             {"tool": "mcp_local__shout", "args": {"text": "hi"}}],
            "done"])
        config = {"mcpServers": {"time": TIME, "local": {"url": url, "timeout": 20}}}
        agent = Agent("clock", "Tell the time.", model=model, mcp_servers=["time", "local"])
        with anyio.fail_after(60):
            async with Deck([agent], mcp=config, store=store) as deck:
                events = [e async for e in deck.stream("clock", "what time is it?")]
    assert events[-1].kind == "run.completed" and events[-1].payload.output == "done"
    tools = set(model.calls[0]["tools"])  # both servers' get_current_time, qualified
    assert {"mcp_time__get_current_time", "mcp_local__get_current_time", "mcp_local__shout"} <= tools
    outputs = {i["call_id"]: json.dumps(i["output"]) for i in model.calls[-1]["input"]
               if isinstance(i, dict) and i.get("type") == "function_call_output"}
    assert '\\"timezone\\": \\"UTC\\"' in outputs["call_1_0"]  # mcp-server-time's JSON reply
    assert "test clock: 12:00 in UTC" in outputs["call_3_0"] and "HI!" in outputs["call_3_1"]
    started = {e.payload.call_id: e.payload.tool for e in events if e.kind == "tool.started"}
    completed = {e.payload.call_id: e.payload for e in events if e.kind == "tool.completed"}
    assert started == {"call_1_0": "mcp_time__get_current_time",
                       "call_3_0": "mcp_local__get_current_time", "call_3_1": "mcp_local__shout"}
    assert set(completed) == set(started)
    assert all(not c.is_error and c.tool == started[i] for i, c in completed.items())
    assert "UTC" in json.dumps(completed["call_1_0"].output)
    assert "HI!" in json.dumps(completed["call_3_1"].output)
    for call_id in started:  # each call starts before it completes
        seqs = [e.seq for e in events if getattr(e.payload, "call_id", None) == call_id]
        kinds = [e.kind for e in events if getattr(e.payload, "call_id", None) == call_id]
        assert kinds == ["tool.started", "tool.completed"] and seqs == sorted(seqs)
    assert (await store.read(events[-1].run_id)) == events


async def test_an_sse_server_when_the_type_says_so(tmp_path, store):
    async with fastmcp(tmp_path, "sse") as url:
        model = ScriptedModel([{"tool": "mcp_old__shout", "args": {"text": "sse"}}, "ok"])
        agent = Agent("a", model=model, mcp_servers=["old"])
        with anyio.fail_after(60):
            async with Deck([agent], mcp={"servers": {"old": {"type": "sse", "url": url}}},
                            store=store) as deck:
                result = await deck.run("a", "go")
    [done] = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert "SSE!" in json.dumps(done.output)


async def test_build_starts_nothing_and_aclose_leaves_no_process(store):
    before = children()
    model = ScriptedModel([{"tool": "mcp_time__get_current_time", "args": {"timezone": "UTC"}}, "ok"])
    offline = Deck([Agent("a", model=model, mcp_servers=["time", "remote"])], store=store,
                   mcp={"time": TIME, "remote": {"url": "http://127.0.0.1:9/mcp"}})
    offline.build()  # no process, no connection (the remote one would refuse)
    assert children() == before
    await offline.aclose()
    deck = Deck([Agent("a", model=model, mcp_servers=["time"])], mcp={"time": TIME}, store=store)
    deck.build()
    assert children() == before
    with anyio.fail_after(60):
        async with deck:
            assert len(children() - before) == 1  # the stdio server, started at open
            result = await deck.run("a", "go")
    assert children() == before
    [done] = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert not done.is_error


async def test_a_files_stdio_servers_run_in_its_directory_wherever_kit_was_started(tmp_path, store):
    """Relative paths of a .mcp.json's stdio server (args here, a cwd) are the file's, as
    Claude Code reads them: they were taken from the directory kit-serve was started in, so
    the server could not start unless that was the file's own."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "faulty.py").write_text(textwrap.dedent(FAULTY))
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {
        "here": {"command": sys.executable, "args": ["faulty.py", "."]},
        "there": {"command": sys.executable, "args": ["../faulty.py", "."], "cwd": "sub"}}}))
    assert Path.cwd() != tmp_path
    model = ScriptedModel([[{"tool": "mcp_here__echo", "args": {"text": "a"}},
                            {"tool": "mcp_there__echo", "args": {"text": "b"}}], "done"])
    agent = Agent("a", model=model, mcp_servers=["here", "there"])
    with anyio.fail_after(60):
        async with Deck([agent], mcp=MCP(tmp_path / ".mcp.json"), store=store) as deck:
            events = [e async for e in deck.stream("a", "go")]
    assert events[-1].kind == "run.completed"
    assert [e.payload.is_error for e in events if e.kind == "tool.completed"] == [False, False]
    assert len(starts(tmp_path)) == 1 and len(starts(tmp_path / "sub")) == 1


async def test_a_server_that_cannot_start_refuses_the_open(store):
    before = children()
    deck = Deck([Agent("a", model=ScriptedModel(["x"]), mcp_servers=["ok", "broken"])], store=store,
                mcp={"ok": TIME, "broken": {"command": "/nonexistent/kit-mcp-server"}})
    with anyio.fail_after(60):
        with pytest.raises(ConfigError, match="MCP server 'broken' failed to start"):
            await deck.__aenter__()
        await deck.aclose()
    assert children() == before  # the one that did start was torn down


async def test_a_server_that_exits_at_once_refuses_the_open_naming_its_exit_code(store):
    """It said only "McpError: Connection closed", whatever the server's exit code."""
    quits = {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]}
    deck = Deck([Agent("a", model=ScriptedModel(["x"]), mcp_servers=["quits"])], store=store,
                mcp={"quits": quits})
    with anyio.fail_after(60):
        with pytest.raises(ConfigError, match=r"^MCP server 'quits' failed to start: "
                                              r"ConnectionError: it is gone \(exit code 3\)"):
            await deck.__aenter__()
        await deck.aclose()


async def test_from_project_reads_the_mcp_json_beside_the_project(tmp_path, store):
    root = tmp_path / "proj"
    (root / "agents" / "a").mkdir(parents=True)
    (root / "agents" / "a" / "agent.py").write_text(
        "import kit\nagent = kit.Agent('a', model=kit.ScriptedModel([{'tool': "
        "'mcp_time__get_current_time', 'args': {'timezone': 'UTC'}}, 'ok']), mcp_servers=['time'])\n")
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"time": TIME}}))
    with anyio.fail_after(60):
        async with Deck.from_project(root, store=store) as deck:
            assert list(deck.mcp.servers) == ["time"]
            result = await deck.run("a", "go")
    [done] = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert "UTC" in json.dumps(done.output) and not done.is_error


async def test_a_call_that_outlasts_the_server_timeout_is_an_error_to_the_model(tmp_path, store):
    async with fastmcp(tmp_path, "streamable-http") as url:
        model = ScriptedModel([{"tool": "mcp_local__slow", "args": {"seconds": 3}}, "ok"])
        agent = Agent("a", model=model, mcp_servers=["local"])
        with anyio.fail_after(60):
            async with Deck([agent], mcp={"local": {"url": url, "timeout": 0.5}}, store=store) as deck:
                result = await deck.run("a", "go")
    [done] = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert done.is_error and "Timed out" in json.dumps(done.output)
    assert "Timed out" in json.dumps(list(model.calls[-1]["input"]))


async def test_a_tool_that_fails_is_an_error_in_the_log_and_its_text_reaches_the_model(tmp_path,
                                                                                       store):
    """MCP reports a tool's failure in its result (``isError``), which the SDK hands the model
    as if it were an answer: kit logs the call as an error, as for any refusal."""
    async with fastmcp(tmp_path, "streamable-http") as url:
        model = ScriptedModel([{"tool": "mcp_local__refuse", "args": {"text": "no way"}},
                               {"tool": "mcp_local__shout", "args": {"text": "hi"}}, "ok"])
        agent = Agent("a", model=model, mcp_servers=["local"])
        with anyio.fail_after(60):
            async with Deck([agent], mcp={"local": {"url": url, "timeout": 20}}, store=store) as deck:
                result = await deck.run("a", "go")
    refused, shouted = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
    assert refused.is_error and "refused: no way" in json.dumps(refused.output)
    assert not shouted.is_error and "HI!" in json.dumps(shouted.output)
    assert "refused: no way" in json.dumps(list(model.calls[1]["input"]))


# ---------------------------------------------------------------- a server that dies or hangs ----

def outputs(events) -> dict[str, object]:
    return {e.payload.tool: e.payload for e in events if e.kind == "tool.completed"}


async def test_a_server_that_dies_in_a_call_is_named_and_restarted_so_the_turn_goes_on(
        tmp_path, store, caplog):
    model = ScriptedModel([{"tool": "mcp_p__crash", "args": {"code": 7}}, "carried on",
                           {"tool": "mcp_p__echo", "args": {"text": "hi"}}, "done"])
    agent = Agent("a", model=model, mcp_servers=["p"])
    with anyio.fail_after(60):
        async with Deck([agent], mcp={"p": faulty(tmp_path)}, store=store) as deck:
            first = await deck.run("a", "crash it")
            second = await deck.run("a", "echo")
    assert first.output == "carried on"  # the listing before the next model call met a new server
    crashed = outputs(await store.read(first.run_id))["mcp_p__crash"]
    said = "MCP server 'p' is gone (exit code 7); the call to crash did not finish"
    assert crashed.is_error and said in crashed.output
    assert said in json.dumps(list(model.calls[1]["input"]))  # the model was told the same
    [old, new] = starts(tmp_path)  # one restart
    echoed = outputs(await store.read(second.run_id))["mcp_p__echo"]
    assert not echoed.is_error and f"hi from {new}" in json.dumps(echoed.output)
    assert [r.getMessage() for r in caplog.records if r.name == "kit.agents"] == [
        "MCP server 'p' is gone (exit code 7); kit restarted it"]
    assert not alive(old) and await gone(new)


async def test_an_http_server_that_restarted_and_forgot_the_session_is_reconnected(tmp_path, store,
                                                                                   caplog):
    """A streamable-HTTP server restarted under the deck answers 404 for kit's session: kit
    opens a new one, so the turn goes on (every later turn failed with 'Session terminated')."""
    model = ScriptedModel([{"tool": "mcp_local__shout", "args": {"text": "hi"}}, "done"], cycle=True)
    agent = Agent("a", model=model, mcp_servers=["local"])
    port = free_port()
    with anyio.fail_after(60):
        server = fastmcp(tmp_path, "streamable-http", port)
        url = await server.__aenter__()
        try:
            async with Deck([agent], mcp={"local": {"url": url, "timeout": 20}}, store=store) as deck:
                await deck.run("a", "before")
                await server.__aexit__(None, None, None)
                server = fastmcp(tmp_path, "streamable-http", port)  # the same URL, a new process
                await server.__aenter__()
                after = await deck.run("a", "after")
                again = await deck.run("a", "and again")
        finally:
            await server.__aexit__(None, None, None)
    for result in (after, again):
        [shouted] = [e.payload for e in await store.read(result.run_id) if e.kind == "tool.completed"]
        assert result.output == "done" and not shouted.is_error and "HI!" in json.dumps(shouted.output)
    assert "MCP server 'local' forgot the session (HTTP 404: it restarted?); kit restarted it" \
        in caplog.text


async def test_runs_that_meet_a_dead_server_at_once_share_one_restart(tmp_path, store, caplog):
    agents = [Agent(f"a{i}", mcp_servers=["p"], model=ScriptedModel(
        [{"tool": "mcp_p__echo", "args": {"text": f"r{i}"}}, "ok"])) for i in range(3)]
    results = {}
    with anyio.fail_after(60):
        async with Deck(agents, mcp={"p": faulty(tmp_path)}, store=store) as deck:
            [old] = starts(tmp_path)
            os.kill(old, signal.SIGKILL)  # dies while idle, between turns
            assert await gone(old)

            async def run(name: str) -> None:
                results[name] = await deck.run(name, "echo")

            async with anyio.create_task_group() as tg:
                for a in agents:
                    tg.start_soon(run, a.name)
    [_, new] = starts(tmp_path)  # three runs met the death; one restart
    for i in range(3):
        echoed = outputs(await store.read(results[f"a{i}"].run_id))["mcp_p__echo"]
        assert results[f"a{i}"].output == "ok" and f"r{i} from {new}" in json.dumps(echoed.output)
    # (Under load, asyncio's child watcher may find the dead server reaped already, logs
    # "Unknown child process" and reports exit code 255: seen once in a loaded run.)
    assert [r.getMessage() for r in caplog.records if r.name == "kit.agents"] in (
        ["MCP server 'p' is gone (killed by SIGKILL); kit restarted it"],
        ["MCP server 'p' is gone (exit code 255); kit restarted it"])


async def test_a_hung_server_is_restarted_and_the_turn_goes_on(tmp_path, store, caplog):
    model = ScriptedModel([{"tool": "mcp_p__hang", "args": {}}, "carried on",
                           {"tool": "mcp_p__echo", "args": {"text": "hi"}}, "done"])
    agent = Agent("a", model=model, mcp_servers=["p"])
    with anyio.fail_after(60):
        # 3 s: the timeout bounds the server's start too, a Python process importing FastMCP,
        # which took over a second on a loaded machine
        async with Deck([agent], mcp={"p": faulty(tmp_path, timeout=3)}, store=store) as deck:
            first = await deck.run("a", "hang it")
            [old, new] = starts(tmp_path)
            assert not alive(old)  # the hung process was killed, not left beside the new one
            second = await deck.run("a", "echo")
    assert first.output == "carried on"
    hung = outputs(await store.read(first.run_id))["mcp_p__hang"]
    assert hung.is_error and "Timed out" in json.dumps(hung.output)  # the call, as documented
    echoed = outputs(await store.read(second.run_id))["mcp_p__echo"]
    assert f"hi from {new}" in json.dumps(echoed.output)
    assert [r.getMessage() for r in caplog.records if r.name == "kit.agents"] == [
        "MCP server 'p' did not answer list_tools in 3 s; kit restarted it"]


async def test_a_server_that_cannot_restart_fails_every_later_turn_at_once_naming_it(tmp_path,
                                                                                    store):
    model = ScriptedModel([{"tool": "mcp_p__crash", "args": {"code": 7, "for_good": True}},
                           "never"])
    agent = Agent("a", model=model, mcp_servers=["p"])
    with anyio.fail_after(60):
        async with Deck([agent], mcp={"p": faulty(tmp_path)}, store=store) as deck:
            with pytest.raises(kit.KitError) as first:
                await deck.run("a", "crash it for good")
            said = str(first.value)  # the restart's failure, as the mcp package words it
            assert re.fullmatch(r"MCP server 'p' is gone \(exit code 7\); restarting it failed "
                                r"\(.+\); it stays down until the deck is reopened", said)
            assert isinstance(first.value, kit.MCPServerError)
            assert (first.value.server, first.value.what) == ("p", "is gone (exit code 7)")
            with anyio.fail_after(1):  # at once: no second try at starting it
                with pytest.raises(kit.KitError, match=re.escape(said)):
                    await deck.run("a", "again")
            assert len(starts(tmp_path)) == 2  # the first start, and one restart that failed
    failed = [e.payload for r in await store.runs() for e in await store.read(r.run_id)
              if e.kind == "run.failed"]
    assert [(f.error, f.message) for f in failed] == [("MCPServerError", said)] * 2
    assert len(model.calls) == 1  # the second turn never reached the model


async def test_close_ends_the_helpers_a_stdio_server_spawned(tmp_path, store):
    model = ScriptedModel([{"tool": "mcp_p__spawn", "args": {}}, "ok"])
    agent = Agent("a", model=model, mcp_servers=["p"])
    helper = None
    try:
        with anyio.fail_after(60):
            async with Deck([agent], mcp={"p": faulty(tmp_path)}, store=store) as deck:
                result = await deck.run("a", "spawn a helper")
                spawned = outputs(await store.read(result.run_id))["mcp_p__spawn"]
                helper = int(re.search(r"\d+", json.dumps(spawned.output)).group())
                assert alive(helper)
            # The server exits on its own when its stdin closes, so the mcp package never
            # reaches for its process group; kit does.
            assert await gone(helper, within=5)
    finally:
        if helper is not None and alive(helper):
            os.kill(helper, signal.SIGKILL)
