"""Tests of ``kit-serve``, the process (kit_serve): a subprocess serving a project on a loopback
port, its exit codes and every line it writes on stderr (asyncio and trio workers)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kit_serve import MAX_LOG_MESSAGE, FailedRunLog
from test_kit_http import SLOW_MCP, free_port
from test_kit_mcp import alive

HERE = Path(__file__).parent

AGENT_BUNDLE = '''
import asyncio
import kit

async def slow(seconds: int) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "slept"

agent = kit.Agent("sleepy", tools=[slow],
                  model=kit.ScriptedModel([{"tool": "slow", "args": {"seconds": 60}}, "done"], cycle=True))
'''


BROKEN_BUNDLE = '''
import os
import kit

leak = RuntimeError("Incorrect API key provided: sk-proj-abcdef123456; token " + os.environ["MY_SERVICE_TOKEN"])
agent = kit.Agent("broken", model=kit.ScriptedModel([leak], cycle=True))
'''


def project(tmp_path: Path, **bundles: str) -> Path:
    """A project directory with one agent bundle per keyword (name=source)."""
    for name, source in bundles.items():
        bundle = tmp_path / "proj" / "agents" / name / "agent.py"
        bundle.parent.mkdir(parents=True)
        bundle.write_text(source)
    return tmp_path / "proj"


def kit_serve(root: Path, *args: str, cwd: Path = HERE, **env: str) -> tuple[subprocess.Popen, str]:
    """``kit-serve`` (as ``python -m kit_http``, which runs it) serving ``root`` on a free loopback
    port, once its /health answers; its stderr is a text pipe."""
    port = free_port()
    env = {**os.environ, "KIT_PROJECT": str(root), "KIT_STORE": "memory", "PORT": str(port),
           "HOST": "127.0.0.1", "PYTHONPATH": str(HERE), **env}
    proc = subprocess.Popen([sys.executable, "-m", "kit_http", *args], cwd=cwd, env=env,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, then the exit and everything it wrote on stderr."""
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        return proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_kit_serve_serves_the_project_and_stops_its_streams_on_sigterm(tmp_path, worker):
    proc, base = kit_serve(project(tmp_path, sleepy=AGENT_BUNDLE), KIT_WORKER=worker)
    try:
        with httpx.stream("POST", f"{base}/agents/sleepy/chat?stream=true", json={"message": "hi"},
                          timeout=10) as r:
            assert r.status_code == 200 and r.headers["x-kit-run-id"]
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            body = r.read()
        assert body == b'event: server.shutdown\ndata: {"run_id":"%s"}\n\n' % r.headers["x-kit-run-id"].encode()
        assert proc.wait(timeout=20) == 0 and time.monotonic() - started < 15
    finally:
        stderr = stop(proc)
    assert f"{base}" in stderr and "unauthenticated" in stderr


def test_an_empty_kit_project_serves_the_default_kit_project(tmp_path):
    """``KIT_PROJECT=`` (exported but empty) is ``.kit``, as unset is; it served the working
    directory itself, with none of the project's agents."""
    bundle = tmp_path / ".kit" / "agents" / "hi" / "agent.py"
    bundle.parent.mkdir(parents=True)
    bundle.write_text("import kit\nagent = kit.Agent('hi', model=kit.ScriptedModel(['hello']))\n")
    proc, base = kit_serve(tmp_path / "unused", cwd=tmp_path, KIT_PROJECT="")
    try:
        assert httpx.get(f"{base}/health", timeout=10).json()["agents"] == ["hi"]
    finally:
        stop(proc)


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_a_second_signal_ends_the_grace_and_the_process_exits(tmp_path, worker):
    """Ctrl-C twice while a JSON turn is in flight: the second raised KeyboardInterrupt in the
    middle of the shutdown, the deck was never closed, and a durable workflow's checkpointer
    thread held the process hung (a third signal ended it). Now the second ends the grace."""
    root = project(tmp_path, sleepy=AGENT_BUNDLE)
    approval = root / "workflows" / "approval" / "workflow.py"  # durable: its checkpointer thread
    approval.parent.mkdir(parents=True)
    approval.write_text((HERE / ".kit" / "workflows" / "approval" / "workflow.py").read_text())
    proc, base = kit_serve(root, KIT_WORKER=worker, KIT_STORE=f"sqlite:///{tmp_path / 'kit.db'}")
    try:
        with httpx.Client(timeout=30) as client:
            sent = client.build_request("POST", f"{base}/agents/sleepy/chat", json={"message": "hi"})
            got: list[httpx.Response] = []
            caller = threading.Thread(target=lambda: got.append(client.send(sent)))
            caller.start()
            time.sleep(1.0)  # the turn sleeps in its tool
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 0
            assert time.monotonic() - started < 4.0  # not the 5 s grace: the second cut it
            caller.join(10)
        [r] = got
        run_id = r.headers["x-kit-run-id"]  # the 503 names the run it cancelled
        assert (r.status_code, r.json()["error"]) == (503, "ServerStoppingError")
        assert run_id in r.json()["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.mark.parametrize("worker, how", [("asyncio", "--access-log"), ("trio", "KIT_ACCESS_LOG=on")])
def test_kit_serve_logs_a_line_per_failed_run_without_secrets_and_per_request(tmp_path, worker, how):
    token = "-".join(("tok", "9f8e7d6c5b4a"))  # not in the source: a log may quote source lines
    args, env = ((how,), {}) if how.startswith("--") else ((), dict([how.split("=")]))
    proc, base = kit_serve(project(tmp_path, broken=BROKEN_BUNDLE), *args, KIT_WORKER=worker,
                           MY_SERVICE_TOKEN=token, **env)
    try:
        r = httpx.post(f"{base}/agents/broken/chat", json={"message": "hi"}, timeout=10)
        assert r.status_code == 500 and "kit runs events" in r.json()["message"]
        failed = [r.headers["x-kit-run-id"]]
        with httpx.stream("POST", f"{base}/agents/broken/chat?stream=true", json={"message": "hi"},
                          timeout=10) as s:
            assert b"event: error" in s.read()
            failed.append(s.headers["x-kit-run-id"])
        forged = "/runs/x%0D%0Akit-serve:%20run%20forged%20(broken)%20failed/events"  # decoded: CR LF
        assert httpx.get(f"{base}{forged}", timeout=10).status_code == 400  # not an id (check_id)
    finally:
        stderr = stop(proc)
    assert token not in stderr and "abcdef123456" not in stderr
    lines = stderr.splitlines()
    assert all(line.startswith("kit-serve: ") for line in lines), stderr
    assert not any(line.startswith("kit-serve: run forged") for line in lines)
    assert any('"GET /runs/x\\r\\nkit-serve: run forged (broken) failed/events" 400' in line
               for line in lines), stderr
    runs = [line for line in lines if " failed: " in line]
    assert runs == [f"kit-serve: run {run_id} (broken) failed: RuntimeError: Incorrect API key "
                    "provided: sk-***; token ***" for run_id in failed]
    access = [line for line in lines if '" 200 ' in line or '" 500 ' in line]
    assert [a.split(" ", 2)[2].rsplit(" ", 1)[0] for a in access] == [
        '"GET /health" 200', '"POST /agents/broken/chat" 500', '"POST /agents/broken/chat" 200']


def test_kit_serve_on_a_taken_port_exits_1_with_one_line(tmp_path):
    root = project(tmp_path, sleepy=AGENT_BUNDLE)  # its log is a SQLite file: nothing opens it
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, KIT_PROJECT=str(root), HOST="127.0.0.1", PORT=str(port))
        env.pop("KIT_STORE", None)
        out = subprocess.run([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    [line] = out.stderr.splitlines()
    assert line.startswith(f"kit-serve: cannot listen on 127.0.0.1:{port}: "), line
    assert not (root / ".state").exists()


@pytest.mark.parametrize("host, url_host", [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]"),
                                            ("[::1]", "[::1]")])
def test_kit_serve_on_port_0_says_the_port_it_serves(tmp_path, host, url_host):
    """On IPv6 it said http://::1:<port> (no URL) for ::1, and bracketed [::1] twice in the
    playground's URL."""
    if ":" in host and not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    env = dict(os.environ, KIT_PROJECT=str(project(tmp_path, sleepy=AGENT_BUNDLE)),
               KIT_STORE="memory", HOST=host, PORT="0")
    proc = subprocess.Popen([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://{url_host}:"
    try:
        line = proc.stderr.readline()  # the first line kit-serve writes
        assert line.startswith(f"kit-serve: listening on {base}"), line
        port = int(line.split(base, 1)[1].split(" ", 1)[0])
        assert port != 0 and f"playground at {base}{port}/;" in line
        deadline = time.monotonic() + 30
        while True:  # the deck opens after the line: the port answers once it has
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                assert httpx.get(f"{base}{port}/health", timeout=1).status_code == 200
                break
            except httpx.TransportError:
                time.sleep(0.1)
    finally:
        stop(proc)


def test_empty_bind_and_worker_settings_are_unset(tmp_path):
    """HOST=, PORT= and KIT_WORKER= exported empty (an env file's blank line) mean unset, as
    every other kit setting's empty value does: 0.0.0.0, 8000 and asyncio. PORT= was a usage
    error, KIT_WORKER= too, and HOST= bound every address under a startup line of
    http://:<port>."""
    root = project(tmp_path, sleepy=AGENT_BUNDLE)
    env = dict(os.environ, KIT_PROJECT=str(tmp_path / "none"), PORT="", HOST="", KIT_WORKER="")
    out = subprocess.run([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stderr) == (1, f"kit-serve: no kit project at "
                                               f"{str(tmp_path / 'none')!r} (a directory with "
                                               "agents/ and workflows/ bundles); set KIT_PROJECT "
                                               "or pass path=\n")
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE="memory", HOST="", KIT_WORKER="",
               PORT="0")
    proc = subprocess.Popen([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("kit-serve: listening on http://0.0.0.0:"), line
        port = int(line.split("http://0.0.0.0:", 1)[1].split(" ", 1)[0])
        assert line.split(f"http://0.0.0.0:{port} ")[1].startswith("(asyncio worker)")
        deadline = time.monotonic() + 30
        while True:  # every address is bound, the loopback one too
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
                break
            except httpx.TransportError:
                time.sleep(0.1)
    finally:
        stop(proc)


def test_a_deck_that_does_not_open_is_one_masked_line_naming_why(tmp_path):
    """Hypercorn wraps the failure ('LifespanFailureError: Lifespan failure in startup. ...'),
    and libpq's message spans lines; kit-serve says the deck's own error, on one line."""
    env = dict(os.environ, KIT_PROJECT=str(project(tmp_path, sleepy=AGENT_BUNDLE)),
               KIT_STORE="postgresql://kit:hunter2222@127.0.0.1:1/nowhere", HOST="127.0.0.1",
               PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    listening, failed = out.stderr.splitlines()
    assert listening.startswith("kit-serve: listening on ") and failed.startswith("kit-serve: ")
    assert "LifespanFailureError" not in failed and "127.0.0.1" in failed, failed
    assert "hunter2222" not in out.stderr


def test_a_store_url_kit_cannot_use_is_one_line_whose_example_url_is_readable(tmp_path):
    """The failure line is masked, and the mask took the user of the hint's example for a
    secret: ``postgresql://***@host/database``, the very URL a user must copy to fix it."""
    root = project(tmp_path, echo="import kit\nagent = kit.Agent('echo', model=kit.ScriptedModel(['hi']))\n")
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE="mysql://app:hunter2222@db/x",
               HOST="127.0.0.1", PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    failed = out.stderr.splitlines()[-1]
    assert failed.startswith("kit-serve: ConfigError: KIT_STORE: unsupported store URL 'mysql://***@db/x'")
    assert failed.endswith(" or 'postgresql://user@host/database[?schema=name]'"), failed
    assert "hunter2222" not in out.stderr


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_an_agent_named_like_the_mcp_answer_tool_exits_1_naming_the_clash(tmp_path, worker):
    """The deck opened, the MCP surface refused the name, and closing the deck from inside a
    shield broke the lifespan: Hypercorn went on without one, serving a closed deck, for good."""
    root = project(tmp_path, answer="import kit\nagent = kit.Agent('answer', model=kit.ScriptedModel(['hi']))\n")
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE="memory", HOST="127.0.0.1",
               PORT=str(free_port()), KIT_WORKER=worker)
    out = subprocess.run([sys.executable, "-m", "kit_http", "--surfaces", "mcp"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    listening, failed = out.stderr.splitlines()
    assert listening.startswith("kit-serve: listening on ")
    assert failed == ("kit-serve: ConfigError: an invocable named 'answer' clashes with the MCP "
                      "server's 'answer' tool; rename it to serve MCP")


def test_a_project_that_fails_to_import_is_one_masked_capped_line(tmp_path):
    """What a bundle raises at import may quote a setting, a URL with its password, or a page
    of text: kit-serve says it on one line, masked and capped, and exits 1."""
    root = project(tmp_path, broken='import os\nraise RuntimeError("no postgresql://app:hunter2222@db/x '
                                    'with " + os.environ["MY_SERVICE_TOKEN"] + "\\n" + "x" * 2000)\n')
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE="memory", HOST="127.0.0.1",
               PORT=str(free_port()), MY_SERVICE_TOKEN="zz-token-value-1234")
    out = subprocess.run([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    [line] = out.stderr.splitlines()
    assert line.startswith(f"kit-serve: {root}/agents/broken/agent.py failed to import: RuntimeError: ")
    assert "hunter2222" not in line and "zz-token-value-1234" not in line and "postgresql://***@db/x" in line
    assert len(line) <= len("kit-serve: ") + MAX_LOG_MESSAGE


def test_ctrl_c_while_the_project_loads_exits_130_without_a_traceback(tmp_path):
    """A user who gives up waiting for a slow start (a bundle that takes its time, a store that
    does not answer) gets the prompt back, not a screen of traceback."""
    loading = tmp_path / "loading"
    root = project(tmp_path, slow=f"import pathlib, time\npathlib.Path({str(loading)!r}).touch()\n"
                                  f"time.sleep(60)\n")
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE="memory", HOST="127.0.0.1",
               PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, "-m", "kit_http"], cwd=HERE, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not loading.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def opening(tmp_path: Path, worker: str) -> tuple[subprocess.Popen, list[int]]:
    """``kit-serve`` whose deck is still opening: its MCP server (SLOW_MCP) started, spawned a
    helper and never answers; with that server's and its helper's process ids. Its stderr is
    the file ``tmp_path / "stderr"`` (a pipe would stay open in an orphaned server)."""
    root = project(tmp_path, a="import kit\nagent = kit.Agent('a', model=kit.ScriptedModel(['hi']), "
                               "mcp_servers=['slow'])\n")
    pids, script = tmp_path / "pids", tmp_path / "slow.py"
    script.write_text(SLOW_MCP)
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"slow": {
        "command": sys.executable, "args": [str(script), str(pids)], "timeout": 120}}}))
    env = dict(os.environ, KIT_PROJECT=str(root), KIT_STORE="memory", HOST="127.0.0.1",
               PORT=str(free_port()), KIT_WORKER=worker)
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kit_http"], cwd=HERE, env=env, stderr=stderr)
    deadline = time.monotonic() + 60
    while not pids.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
        time.sleep(0.05)
    return proc, [int(pid) for pid in pids.read_text().split()]


def ended(proc: subprocess.Popen, pids: list[int]) -> tuple[int | None, list[int]]:
    """``proc``'s exit code (None: still running after 30 s) and which of ``pids`` outlived it
    by 10 s; every one of them is killed."""
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid)]
    for pid in [proc.pid, *left] if code is None else left:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    return code, left


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_ctrl_c_while_the_deck_opens_exits_130_quietly_and_ends_its_mcp_servers(tmp_path, worker):
    """Under trio, Hypercorn's nursery wrapped the KeyboardInterrupt in an exception group: a
    traceback and exit 1."""
    proc, pids = opening(tmp_path, worker)
    proc.send_signal(signal.SIGINT)
    assert ended(proc, pids) == (130, [])
    [listening] = (tmp_path / "stderr").read_text().splitlines()
    assert listening.startswith("kit-serve: listening on ")


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_sigterm_while_the_deck_opens_exits_143_and_ends_its_mcp_servers(tmp_path, worker):
    """A service manager stopping kit-serve as it starts: SIGTERM's default killed the process
    at once, and the MCP server starting and the helper it spawned lived on, orphaned."""
    proc, pids = opening(tmp_path, worker)
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, pids) == (143, [])
    [listening] = (tmp_path / "stderr").read_text().splitlines()
    assert listening.startswith("kit-serve: listening on ")


def test_kit_serve_logs_no_mcp_request_body(tmp_path):
    """The mcp package logs a request that fails validation, quoted, many lines long, through
    the root logger; kit answers such a request itself now (``kit_mcp.refusal``), naming the
    field at fault, and kit-serve's console quotes none of it."""
    proc, base = kit_serve(project(tmp_path, sleepy=AGENT_BUNDLE), KIT_SURFACES="mcp")
    try:
        r = httpx.post(f"{base}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                            "params": {"name": 5, "note": "zz-client-secret"}},
                       headers={"accept": "application/json, text/event-stream"}, timeout=10)
        assert r.status_code == 200 and '"code":-32602' in r.text and "params.name" in r.text
        assert "zz-client-secret" not in r.text
    finally:
        stderr = stop(proc)
    assert "zz-client-secret" not in stderr
    assert all(line.startswith("kit-serve: ") for line in stderr.splitlines()), stderr


NOISY_BUNDLE = '''
import logging
import kit

try:
    raise ValueError("zz-exception-message")
except ValueError:  # a project's own warning: a line break, a terminal escape, a traceback
    logging.getLogger("noisy").warning("loaded\\nkit-serve: FORGED by a project \\x1b[2J" + "x" * 1000,
                                       exc_info=True)
agent = kit.Agent("noisy", model=kit.ScriptedModel(["hi"]))
'''


def test_kit_serve_prints_every_logger_on_one_capped_line_without_mcp_request_values(tmp_path):
    """The mcp package's loggers (``mcp.server.*``) quote a tool call's name and a bad
    Content-Type verbatim, and a project may log what it likes: every record that reaches
    kit-serve's console is one ``kit-serve:`` line, no terminal escape, capped, and the mcp
    package's say nothing of the request."""
    proc, base = kit_serve(project(tmp_path, noisy=NOISY_BUNDLE), KIT_SURFACES="mcp")
    head = {"accept": "application/json, text/event-stream"}
    forged = "kit-serve: run 18eae0000000000000000000000000ff (noisy) failed: FORGED zz-name"
    try:
        call = {"name": f"nope\n{forged}\x1b[31mRED", "arguments": {}}
        r = httpx.post(f"{base}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                            "params": call}, headers=head, timeout=10)
        assert r.status_code == 200 and "UnknownNameError" in r.text
        r = httpx.post(f"{base}/mcp", timeout=10,  # a good message, a bad Content-Type
                       content=b'{"jsonrpc": "2.0", "id": 2, "method": "tools/list"}',
                       headers={**head, "content-type": "text/x-zz-type" + "A" * 4000})
        assert r.status_code == 400
    finally:
        stderr = stop(proc)
    lines = stderr.splitlines()
    assert all(line.startswith("kit-serve: ") for line in lines), stderr
    assert "\x1b" not in stderr and "zz-" not in stderr and "AAAA" not in stderr, stderr
    assert not any(line.startswith(("kit-serve: run 18eae", "kit-serve: FORGED")) for line in lines)
    assert "Traceback" not in stderr and "zz-exception-message" not in stderr
    [listening] = [line for line in lines if line.startswith("kit-serve: listening on ")]
    assert listening.endswith("cancel runs.")  # kit's own line, whole; every other one capped
    others = [line for line in lines if line != listening]
    assert all(len(line) <= len("kit-serve: ") + MAX_LOG_MESSAGE for line in others), others
    [noisy] = [line for line in others if "FORGED by a project" in line]
    assert noisy.startswith("kit-serve: loaded\\nkit-serve: FORGED by a project \\x1b[2Jxxx")
    assert noisy.endswith("x...") and len(noisy) == len("kit-serve: ") + MAX_LOG_MESSAGE
    assert [line for line in others if " mcp: " in line] == [
        "kit-serve: mcp: mcp.server.lowlevel.server: a warning about a request (its text is not "
        "logged: it may quote the request)",
        "kit-serve: mcp: mcp.server.transport_security: a warning about a request (its text is "
        "not logged: it may quote the request)"]


@pytest.mark.parametrize("port", ["http", "-1", "65536", "\u00b2"])  # '²' passes isdigit, not int()
def test_kit_serve_refuses_a_port_that_is_no_port(port, capsys):
    import kit_serve
    with pytest.raises(SystemExit) as exited:
        kit_serve.main(["--port", port])
    assert exited.value.code == 2
    assert f"the port must be a number from 0 to 65535, got {port!r}" in capsys.readouterr().err


@pytest.mark.parametrize("value, on", [("on", True), ("YES", True), ("1", True), ("off", False),
                                       ("0", False), ("", False), ("loud", None)])
def test_kit_serve_reads_the_access_log_switch_as_every_switch(value, on, monkeypatch, capsys):
    """KIT_ACCESS_LOG=on was off without a word (1, true and yes only); an unknown value is
    named now. The switches read alike: KIT_PLAYGROUND=off turns the page off."""
    import kit_serve
    from kit_core import switch_setting
    monkeypatch.setenv("KIT_ACCESS_LOG", value)
    if on is None:
        with pytest.raises(SystemExit) as exited:
            kit_serve.main(["--port", "http"])
        assert exited.value.code == 2
        assert "KIT_ACCESS_LOG must be 1, true, yes or on, or 0, false, no or off, got 'loud'" \
            in capsys.readouterr().err
    else:
        assert switch_setting("KIT_ACCESS_LOG", value, False) is on


#: Bundles whose tool (node) writes the names of the modules the serving process has loaded to
#: the file KIT_TEST_MODULES names: what kit-serve imported to serve a project and play a turn.
_WRITE_MODULES = '''
import os, sys

def write_modules() -> str:
    """Write the names of the loaded modules."""
    with open(os.environ["KIT_TEST_MODULES"], "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
    return "written"
'''
MODULES_AGENT = _WRITE_MODULES + '''
import kit
agent = kit.Agent("modules", tools=[write_modules], model=kit.ScriptedModel(
    [{"tool": "write_modules", "args": {}}, "done"], cycle=True))
'''
MODULES_WORKFLOW = _WRITE_MODULES + '''
from typing import TypedDict
from langgraph.graph import StateGraph
import kit

class State(TypedDict, total=False):
    done: str

graph = StateGraph(State).add_node("write", lambda state: {"done": write_modules()})
workflow = kit.Workflow("modules", graph.set_entry_point("write").set_finish_point("write"))
'''
#: What no project here uses, hence what serving it must never import: the MCP client side (no
#: .mcp.json) and server side (no mcp surface), Postgres, Redis, SQLAlchemy sessions, tracing,
#: genai-prices (a ScriptedModel has no price), trio (the asyncio worker), the OpenAPI document
#: (no GET /openapi.json).
_UNUSED = ("kit_mcp_servers", "agents.mcp.server", "kit_mcp", "kit_tracing", "kit_otlp",
           "psycopg", "psycopg_pool", "redis", "sqlalchemy", "genai_prices", "trio", "kit_openapi")


@pytest.mark.parametrize("kind", ["example", "workflows"])
def test_kit_serve_imports_only_what_the_project_uses(tmp_path, kind):
    """The example project (an agent, a durable workflow, a skill; no MCP server, no Postgres, no
    tracing), with an agent that writes the modules loaded after its turn, and a project of
    workflows only, which never loads the agents SDK (issue 16: import only what a project
    uses: every module is memory for the process's whole life)."""
    root = tmp_path / "proj"
    if kind == "example":
        shutil.copytree(HERE / ".kit", root)
        (root / "agents" / "modules").mkdir()
        (root / "agents" / "modules" / "agent.py").write_text(MODULES_AGENT)
        path, unused = "/agents/modules/chat", _UNUSED
    else:
        (root / "workflows" / "modules").mkdir(parents=True)
        (root / "workflows" / "modules" / "workflow.py").write_text(MODULES_WORKFLOW)
        path = "/workflows/modules"
        unused = (*_UNUSED, "agents", "openai", "mcp", "kit_agents", "kit_sessions", "kit_scripted")
    written = tmp_path / "modules.txt"
    proc, base = kit_serve(root, KIT_STORE="", KIT_TEST_MODULES=str(written))
    try:
        r = httpx.post(f"{base}{path}", json={"message": "hi"} if kind == "example" else {},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        stop(proc)
    loaded = set(written.read_text().split())
    assert "kit_runtime" in loaded  # the file is the served process's
    assert sorted(m for m in loaded if m.split(".")[0] in unused or m in unused) == []


def test_kit_serve_names_the_extra_a_worker_needs():
    code = "import sys; sys.modules['trio'] = None; import kit_serve; sys.exit(kit_serve.main(['--worker', 'trio']))"
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stderr) == (1, "kit-serve: trio is missing: pip install 'kit[trio]'\n")


def test_a_failure_message_is_logged_on_one_line_with_its_secrets_masked():
    log = FailedRunLog({"OPENAI_API_KEY": "sk-live-0123456789", "HOME": "/home/someone-long"})
    assert log.redact("401: key sk-live-0123456789 refused\nretry") == "401: key *** refused retry"
    assert log.redact("Authorization: Bearer abc.def-ghi") == "Authorization: Bearer ***"
    assert log.redact("cannot reach redis://kit:hunter22@cache:6379/0") == "cannot reach redis://***@cache:6379/0"
    # A password up to the URL's last @, a / or an @ in it too; a token as the user; a user alone
    # (the hints' example URLs) is no secret.
    assert log.redact("no postgresql://app:pa/ss@w@db/x here") == "no postgresql://***@db/x here"
    assert log.redact("git https://ghp_0123456789abcdef@github.com/o/r") == "git https://***@github.com/o/r"
    assert log.redact("or 'postgresql://user@host/db'") == "or 'postgresql://user@host/db'"
    # Tokens by their well-known prefixes (a tool's error may quote the one it sent).
    for token, shown in (("ghp_0123456789abcdefABCDEF0123456789abcd", "ghp_***"),
                         ("github_pat_11ABCDEFG0123456789_abcdef", "github_pat_***"),
                         ("glpat-0123456789abcdefghij", "glpat-***"), ("xoxb-123456789012-abcdef", "xoxb-***"),
                         ("AIzaSyA0123456789abcdefghijklmnopq", "AIza***"), ("AKIAIOSFODNN7EXAMPLE", "AKIA***"),
                         ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "eyJ***")):
        assert log.redact(f"401 for {token}: bad credentials") == f"401 for {shown}: bad credentials"
    assert log.redact("AKIA is a prefix; eyJ too; ghp_short") == "AKIA is a prefix; eyJ too; ghp_short"
    assert log.redact('{"api_key": "xyz123", "password": "p4ss"}') == '{"api_key": "***", "password": "***"}'
    assert log.redact("no such file /home/someone-long/x") == "no such file /home/someone-long/x"  # not a secret
    assert log.redact("the api_key client option must be set") == "the api_key client option must be set"
    assert len(log.redact("x" * 1000)) == MAX_LOG_MESSAGE
    assert log.redact("bad tool \x1b]0;owned\x07 output") == "bad tool \\x1b]0;owned\\x07 output"
