"""Tests of the ``kit`` console script against a real log file (in this process, and as a
subprocess where the process matters: a closed pipe)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

import kit
import kit_cli as cli
from kit_pg import store_from_url
from kit_store import SQLiteStore
from kit_storebase import READ_PAGE
from test_kit_control import Gate

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def kit_cli(*args: str) -> Ran:
    """``kit ...`` in this process (``kit_cli.main``), its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return Ran(code, out.getvalue(), err.getvalue())


async def test_runs_list_reads_the_log(shared_url):
    async with store_from_url(shared_url) as store:
        model = kit.ScriptedModel(["hi", RuntimeError("down"), "hi"])
        async with kit.Deck([kit.Agent("greeter", model=model)], store=store) as deck:
            ok = await deck.run("greeter", "hello", session_id="s1")
            with pytest.raises(RuntimeError):
                await deck.run("greeter", "again", session_id="s2")
            tenant = await deck.run("greeter", "hello", session_id="s1", namespace="tenant-a")
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url)
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert header.split() == ["RUN_ID", "STATUS", "NAME", "NAMESPACE", "SESSION", "STARTED"]
    assert len(lines) == 3 and lines[0].startswith(ok.run_id) and "COMPLETED" in lines[0]
    assert "FAILED" in lines[1] and "s2" in lines[1]
    # Session s1 twice, two conversations: the namespace tells them apart.
    assert [line.split()[3:5] for line in (lines[0], lines[2])] == [["-", "s1"], ["tenant-a", "s1"]]
    assert lines[2].startswith(tenant.run_id)
    assert [line.index("greeter") for line in lines] == [header.index("NAME")] * 3  # columns align
    assert [line.index("s1") for line in (lines[0], lines[2])] == [header.index("SESSION")] * 2
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url,
                                         "--status", "FAILED", "--json")
    [row] = [json.loads(line) for line in out.stdout.splitlines()]
    assert (row["status"], row["name"], row["session_id"]) == ("FAILED", "greeter", "s2")
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url, "--json")
    assert [json.loads(line)["namespace"] for line in out.stdout.splitlines()] == [None, None, "tenant-a"]
    # One tenant's runs: a session id is per namespace, so --session with it is one conversation.
    for extra in ((), ("--session", "s1")):
        out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url,
                                             "--namespace", "tenant-a", "--json", *extra)
        assert out.returncode == 0, out.stderr
        assert [json.loads(line)["run_id"] for line in out.stdout.splitlines()] == [tenant.run_id]
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url,
                                         "--namespace", "tenant-b")
    assert (out.returncode, out.stdout.splitlines()[1:]) == (0, []), out.stderr


def next_page(ran: Ran) -> list[str] | None:
    """The arguments of the command the hint on stderr gives for the next page, if any."""
    hint = [line for line in ran.stderr.splitlines() if "next page" in line]
    if not hint:
        return None
    words = shlex.split(hint[0].split("the next page: ", 1)[1])
    assert words[:3] == ["kit", "runs", "list"]
    return words[1:]


async def test_runs_list_pages_newest_first_and_says_how_to_get_the_next_page(shared_url):
    async with store_from_url(shared_url) as store:
        for i in range(cli.LIST_LIMIT + 2):
            await store.append([kit.Event(f"run-{i:03}", 0, kit.RunStarted(
                "ab"[i % 2], "agent", f"s{i % 3}", "t", ()), "a")])
        everything = [r.run_id for r in await store.runs()]
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url)
    header, *lines = ran.stdout.splitlines()
    assert header.split()[0] == "RUN_ID" and ran.returncode == 0, ran.stderr
    assert [line.split()[0] for line in lines] == everything[2:]  # the LIST_LIMIT newest
    assert next_page(ran) == ["runs", "list", "--store", shared_url, "--before", everything[2]]

    seen, args = [], ["runs", "list", "--limit", "20", "--store", shared_url]
    while args is not None:  # each hint, run as printed, walks on to the oldest page
        ran = await anyio.to_thread.run_sync(kit_cli, *args)
        header, *lines = ran.stdout.splitlines()
        assert header.split()[0] == "RUN_ID" and ran.returncode == 0, ran.stderr
        seen[:0] = [line.split()[0] for line in lines]
        args = next_page(ran)
        assert args is None or args[args.index("--limit") + 1] == "20"
    assert seen == everything and len(lines) == len(everything) % 20

    args = ["runs", "list", "--name", "a", "--session", "s1", "--namespace", "t", "--limit", "3",
            "--json", "--store", shared_url]
    expected = [r for r in everything if int(r[4:]) % 2 == 0 and int(r[4:]) % 3 == 1]
    seen = []
    while args is not None:  # filters and --json ride along in the hint
        ran = await anyio.to_thread.run_sync(kit_cli, *args)
        seen[:0] = [json.loads(line)["run_id"] for line in ran.stdout.splitlines()]
        args = next_page(ran)
        assert args is None or ("--json" in args and args[args.index("--name") + 1] == "a"
                                and args[args.index("--namespace") + 1] == "t")
    assert seen == expected and len(expected) > 3

    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--before", everything[1],
                                         "--store", shared_url)
    assert [line.split()[0] for line in ran.stdout.splitlines()[1:]] == everything[:1]
    assert ran.stderr == ""  # the oldest page: no hint
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--before", "nope",
                                         "--store", shared_url)
    assert ran.returncode == 1 and "'nope'" in ran.stderr
    for bad in ("0", "-3", "many"):
        ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--limit", bad,
                                             "--store", shared_url)
        assert ran.returncode == 2 and "--limit" in ran.stderr and "positive" in ran.stderr
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--before", "",
                                         "--store", shared_url)
    assert ran.returncode == 2 and "--before" in ran.stderr
    if shared_url.startswith("postgresql://"):  # a password never reaches the hint
        with_password = shared_url.replace("postgres@", "postgres:s3cret@")
        ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", with_password)
        assert ran.returncode == 0 and "s3cret" not in ran.stderr and "postgres:***@" in ran.stderr


def test_usage_errors_exit_2_and_a_missing_log_exits_1(tmp_path, monkeypatch):
    monkeypatch.delenv("KIT_STORE", raising=False)
    monkeypatch.delenv("KIT_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    out = kit_cli("runs", "list")  # no log where kit-serve would keep it: say where it looked
    assert out.returncode == 1 and f"no event log at {tmp_path}/.kit/.state/kit.db" in out.stderr
    assert "KIT_PROJECT" in out.stderr and "--store" in out.stderr
    out = kit_cli("runs", "list", "--store", "mysql://x")
    assert out.returncode == 2 and "mysql://x" in out.stderr
    monkeypatch.setenv("KIT_STORE", "memory")
    out = kit_cli("runs", "list")
    assert out.returncode == 2 and "in-memory" in out.stderr
    out = kit_cli("runs", "frobnicate")
    assert out.returncode == 2
    out = kit_cli("runs", "list", "--store", f"sqlite:///{tmp_path}/none.db")
    assert out.returncode == 1 and "no event log" in out.stderr
    assert not (tmp_path / "none.db").exists()


def test_an_empty_kit_store_is_unset_and_a_bad_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("KIT_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KIT_STORE", " ")  # exported but empty: the project's log, as unset
    out = kit_cli("runs", "list")
    assert out.returncode == 1 and f"no event log at {tmp_path}/.kit/.state/kit.db" in out.stderr
    monkeypatch.setenv("KIT_STORE", "mysql://x")
    out = kit_cli("runs", "list")
    assert out.returncode == 2 and out.stderr.startswith("kit: KIT_STORE: unsupported store URL")
    out = kit_cli("runs", "list", "--store", "mysql://y")
    assert out.returncode == 2 and out.stderr.startswith("kit: --store: unsupported store URL")


def test_an_empty_kit_project_is_the_default_project(tmp_path, monkeypatch):
    monkeypatch.delenv("KIT_STORE", raising=False)
    monkeypatch.setenv("KIT_PROJECT", "")  # exported but empty: .kit, as unset
    monkeypatch.chdir(tmp_path)
    out = kit_cli("runs", "list")
    assert out.returncode == 1 and f"no event log at {tmp_path}/.kit/.state/kit.db" in out.stderr


async def one_run(root: Path, name: str) -> str:
    """A project at ``root`` with one agent, played once into the project's own log."""
    bundle = root / "agents" / name / "agent.py"
    bundle.parent.mkdir(parents=True)
    bundle.write_text(f"import kit\nagent = kit.Agent({name!r}, model=kit.ScriptedModel(['hi']))\n")
    async with kit.Deck.from_project(root) as deck:
        return (await deck.run(name, "hello")).run_id


async def test_the_log_is_found_the_way_kit_serve_finds_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KIT_STORE", raising=False)
    monkeypatch.delenv("KIT_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    default = await one_run(tmp_path / ".kit", "ant")  # KIT_PROJECT unset: .kit
    named = await one_run(tmp_path / "proj", "bee")
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json")
    assert [json.loads(line)["run_id"] for line in ran.stdout.splitlines()] == [default]
    monkeypatch.setenv("KIT_PROJECT", str(tmp_path / "proj"))
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json")
    assert [json.loads(line)["run_id"] for line in ran.stdout.splitlines()] == [named]
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{tmp_path}/.kit/.state/kit.db")  # KIT_STORE wins
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json")
    assert [json.loads(line)["run_id"] for line in ran.stdout.splitlines()] == [default]
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json", "--store",  # --store wins
                                         f"sqlite:///{tmp_path}/proj/.state/kit.db")
    assert [json.loads(line)["run_id"] for line in ran.stdout.splitlines()] == [named]


async def test_runs_events_prints_the_log_as_json_lines_and_follows_a_live_run(tmp_path):
    db, gate = tmp_path / "kit.db", Gate()
    worker = kit.Agent("worker", tools=[gate.wait_tool()],
                       model=kit.ScriptedModel([{"tool": "wait", "args": {"step": 1}}, "done"]))
    async with SQLiteStore(db) as store:
        async with kit.Deck([worker], store=store) as deck:
            async with anyio.create_task_group() as tg:
                stream = deck.stream("worker", "go", session_id="s1")  # its start is committed
                run_id = (await stream.__anext__()).run_id
                tg.start_soon(stream.aclose)
                followed: list[Ran] = []

                async def follow() -> None:
                    followed.append(await anyio.to_thread.run_sync(
                        kit_cli, "runs", "events", run_id, "--follow", "--store", f"sqlite:///{db}"))
                with anyio.fail_after(20):
                    tg.start_soon(follow)
                    await gate.until_entered()
                    await anyio.sleep(0.2)  # the follower is waiting on a live run
                    gate.release.set()
            logged = [e.to_json() for e in await store.read(run_id)]
    assert followed[0].returncode == 0, followed[0].stderr
    assert [json.loads(line) for line in followed[0].stdout.splitlines()] == logged
    assert logged[-1]["kind"] == "run.completed"
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "events", run_id, "--store", f"sqlite:///{db}")
    assert out.stdout.splitlines() == followed[0].stdout.splitlines()
    # --after: where a broken --follow left off, each later event once, none before.
    for after, code, shown in ((2, 0, logged[3:]), (len(logged) - 1, 0, []), (-1, 0, logged),
                               (len(logged), 1, [])):
        out = await anyio.to_thread.run_sync(kit_cli, "runs", "events", run_id, "--after", str(after),
                                             "--store", f"sqlite:///{db}")
        assert (out.returncode, [json.loads(line) for line in out.stdout.splitlines()]) == (code, shown)
    assert out.stderr == f"kit: run {run_id} has no event {len(logged)} (its last is {len(logged) - 1})\n"
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "events", run_id, "--after", "2", "--follow",
                                         "--store", f"sqlite:///{db}")
    assert [json.loads(line) for line in out.stdout.splitlines()] == logged[3:]
    for bad in ("x", "-2", "1.5", "\u00b2"):
        out = await anyio.to_thread.run_sync(kit_cli, "runs", "events", run_id, "--after", bad)
        assert out.returncode == 2 and "--after: must be an event seq" in out.stderr, bad
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "events", "nope", "--store", f"sqlite:///{db}")
    assert out.returncode == 1 and "'nope'" in out.stderr


async def test_runs_events_prints_a_log_longer_than_a_page_whole_in_order_once_each(shared_url):
    """``kit runs events`` reads a finished run's log a page (READ_PAGE) at a time, as it
    prints, where it read the whole log first: every event still prints once, in order."""
    from test_kit_store import long_run
    n = 2 * READ_PAGE + 7
    async with store_from_url(shared_url) as store:
        await store.append(long_run("long", n))
    for after, want in ((None, range(n)), (READ_PAGE - 1, range(READ_PAGE, n))):
        more = () if after is None else ("--after", str(after))
        out = await anyio.to_thread.run_sync(kit_cli, "runs", "events", "long", *more,
                                             "--store", shared_url)
        assert out.returncode == 0, out.stderr
        assert [json.loads(line)["seq"] for line in out.stdout.splitlines()] == list(want)


async def test_following_a_run_whose_process_died_ends_once_its_lease_lapses(tmp_path, monkeypatch):
    """A run whose process died (its lease no longer renewed) never ends by itself until a deck
    opens and reaps it: ``--follow`` waited on it for good. It prints the log so far, then says
    the run has no process and exits 1."""
    db = tmp_path / "kit.db"
    async with SQLiteStore(db) as store:
        await store.append([kit.Event("orphan", 0, kit.RunStarted("a", "agent"), "a")],
                           claims=[kit.Claim("orphan", "a-process-killed-since", 0.5)])
        logged = [e.to_json() for e in await store.read("orphan")]
    monkeypatch.setattr(cli, "LEASE_CHECK", 0.1)
    with anyio.fail_after(10):  # (the old follow waited for good: abandoned, it fails here)
        ran = await anyio.to_thread.run_sync(
            kit_cli, "runs", "events", "orphan", "--follow", "--store", f"sqlite:///{db}",
            abandon_on_cancel=True)
    assert ran.returncode == 1, ran.stderr
    assert [json.loads(line) for line in ran.stdout.splitlines()] == logged
    assert ran.stderr.startswith("kit: run orphan has had no process playing it since ")
    assert "its lease lapsed" in ran.stderr and "records it as abandoned" in ran.stderr


async def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    db = tmp_path / "kit.db"
    async with SQLiteStore(db) as store:  # more rows than a pipe holds (64 KiB)
        await store.append([kit.Event(f"run-{i:05}", 0, kit.RunStarted("a", "agent", f"s{i}", None, ()), "a")
                            for i in range(2000)])
    for args in (["runs", "list", "--json", "--limit", "2000"], ["runs", "list", "--limit", "2000"]):
        proc = subprocess.Popen([sys.executable, "-m", "kit_cli", *args, "--store", f"sqlite:///{db}"],
                                cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = await anyio.to_thread.run_sync(proc.stdout.readline)  # `| head -1`
        proc.stdout.close()
        with anyio.fail_after(30):
            code = await anyio.to_thread.run_sync(proc.wait)
        assert first.strip() and (code, proc.stderr.read()) == (0, "")
        proc.stderr.close()


#: As an HTTP client could send it before kit refused control characters in ids (``check_id``):
#: a log written then still holds it.
EVIL = "x\u001b[2J\u001b]0;PWNED\u0007\nfake-row"


async def test_values_from_the_log_reach_the_terminal_as_text_one_run_one_line(shared_url):
    evil = kit.new_run_id()
    async with store_from_url(shared_url) as store:
        await store.append([kit.Event(evil, 0, kit.RunStarted("greeter", "agent", EVIL), "greeter"),
                            kit.Event(evil, 1, kit.RunCompleted("hi"), "greeter")])
        await store.append([kit.Event("run-\u009b31m\u202e", 0, kit.RunStarted(  # C1 CSI, bidi
            "na\\me\r", "agent", "s\u2028t", "t\x85n", ()), "a")])
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", shared_url)
    assert ran.returncode == 0, ran.stderr
    header, *lines = ran.stdout.split("\n")[:-1]  # split on LF only: no other line break either
    assert len(lines) == 2 and all(line.isprintable() for line in [header, *lines])
    [row] = [line for line in lines if line.startswith(evil)]
    assert row.split()[3:5] == ["-", r"x\x1b[2J\x1b]0;PWNED\x07\nfake-row"]  # one cell, escaped
    [other] = [line for line in lines if not line.startswith(evil)]
    assert other.split()[:5] == [r"run-\x9b31m\u202e", "RUNNING", r"na\me\r", r"t\x85n", r"s\u2028t"]
    assert [line.index("greeter" if line is row else "na") for line in lines] == (
        [header.index("NAME")] * 2)  # the columns still align
    listed = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json",
                                            "--store", shared_url)
    events = await anyio.to_thread.run_sync(kit_cli, "runs", "events", evil,
                                            "--store", shared_url)
    for ran in (listed, events):  # JSON lines escape them themselves (ASCII), and keep them
        assert ran.returncode == 0 and ran.stdout.isascii(), ran.stderr
        assert all(line.isprintable() for line in ran.stdout.split("\n"))
    assert EVIL in [json.loads(line)["session_id"] for line in listed.stdout.splitlines()]
    assert json.loads(events.stdout.splitlines()[0])["payload"]["session_id"] == EVIL


def test_a_file_that_is_not_kit_s_log_is_refused_naming_it_and_left_as_it_is(tmp_path):
    other = tmp_path / "other.db"  # someone else's database
    with contextlib.closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE users(name TEXT)")
        db.execute("INSERT INTO users VALUES ('ann')")
        db.commit()
    (tmp_path / "empty.db").write_bytes(b"")
    (tmp_path / "garbage.db").write_bytes(bytes(range(256)) * 16)
    (tmp_path / "dir.db").mkdir()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for name, says in (("other.db", "is not a kit event log"), ("garbage.db", "not a database"),
                       ("empty.db", "is not a kit event log"), ("dir.db", "cannot read")):
        for args in (["runs", "list"], ["runs", "list", "--json"], ["runs", "events", "r1"],
                     ["runs", "events", "r1", "--follow"], ["runs", "signal", "r1", "cancel"]):
            ran = kit_cli(*args, "--store", f"sqlite:///{tmp_path / name}")
            assert (ran.returncode, ran.stdout) == (1, ""), ran
            assert f"{tmp_path / name} (from --store)" in ran.stderr
            assert says in ran.stderr and "--store" in ran.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


async def logged(db: Path) -> str:
    """A closed kit log at ``db`` with one run in it; its run id."""
    async with SQLiteStore(db) as store:
        await store.append([kit.Event("r1", 0, kit.RunStarted("a", "agent", "s1", None, ()), "a")])
    return "r1"


async def test_arguments_that_are_not_utf8_are_usage_errors_naming_them(tmp_path):
    db = tmp_path / "kit.db"
    run_id, store = await logged(db), f"sqlite:///{db}"
    before = db.read_bytes()
    bad = "\udcff"  # what Python makes of the byte 0xff in argv (PEP 383)
    for args, names in ((["runs", "events", bad, "--store", store], "run_id"),
                        (["runs", "list", "--name", bad, "--store", store], "--name"),
                        (["runs", "list", "--session", bad, "--store", store], "--session"),
                        (["runs", "list", "--before", bad, "--store", store], "--before"),
                        (["runs", "signal", bad, "cancel", "--store", store], "run_id"),
                        (["runs", "signal", run_id, "cancel", "--reason", "why" + bad,
                          "--store", store], "--reason"),
                        (["runs", "list", "--store", store + bad], "--store")):
        ran = await anyio.to_thread.run_sync(kit_cli, *args)
        assert ran.returncode == 2 and f"argument {names}: must be UTF-8" in ran.stderr, ran
    ran = await anyio.to_thread.run_sync(lambda: subprocess.run(  # the bytes a shell passes
        [sys.executable, "-m", "kit_cli", "runs", "signal", run_id, "pause",
         "--reason", b"\xff", "--store", store], cwd=HERE, capture_output=True, timeout=60))
    assert ran.returncode == 2 and b"argument --reason: must be UTF-8" in ran.stderr, ran.stderr
    assert db.read_bytes() == before and not list(tmp_path.glob("kit.db-*"))  # nothing written


async def test_a_limit_past_the_cap_is_a_usage_error_saying_the_cap(tmp_path):
    db = tmp_path / "kit.db"
    await logged(db)
    for limit in ("99999999999999999999999", str(2 ** 63), "100001"):  # past SQLite's INTEGER too
        ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--limit", limit,
                                             "--store", f"sqlite:///{db}")
        assert ran.returncode == 2 and "argument --limit" in ran.stderr, ran
        assert f"at most {cli.LIST_LIMIT_MAX}" in ran.stderr and cli.LIST_LIMIT_MAX == 100_000
    ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json", "--limit",
                                         str(cli.LIST_LIMIT_MAX), "--store", f"sqlite:///{db}")
    assert ran.returncode == 0 and json.loads(ran.stdout)["run_id"] == "r1"


async def test_an_empty_store_is_a_usage_error_not_another_log(tmp_path, monkeypatch):
    db = tmp_path / "kit.db"
    await logged(db)
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{db}")  # an empty --store does not fall back to it
    for args in (["runs", "list"], ["runs", "events", "r1"], ["runs", "signal", "r1", "cancel"]):
        ran = await anyio.to_thread.run_sync(kit_cli, *args, "--store", "")
        assert (ran.returncode, ran.stdout) == (2, "") and "argument --store" in ran.stderr, ran



async def test_an_empty_run_id_name_or_session_is_a_usage_error(tmp_path):
    """An empty run id, --name or --session (a shell variable that was not set) is a usage
    error naming the argument, as an empty --before is: no run, agent or session is named ''.
    The run id was looked for (exit 1, "the log has no run ''"); the filters listed nothing."""
    db = tmp_path / "kit.db"
    await logged(db)
    store = f"sqlite:///{db}"
    for args, argument in ((["runs", "events", ""], "run_id"),
                           (["runs", "signal", "", "cancel"], "run_id"),
                           (["runs", "list", "--name", ""], "--name"),
                           (["runs", "list", "--session", ""], "--session"),
                           (["runs", "list", "--namespace", ""], "--namespace")):
        ran = await anyio.to_thread.run_sync(kit_cli, *args, "--store", store)
        assert (ran.returncode, ran.stdout) == (2, ""), ran
        assert f"argument {argument}: must not be empty" in ran.stderr, ran.stderr

# ============================================================== a log it may only read ====

def where_read_only(folder: Path, *command: str) -> subprocess.CompletedProcess:
    """``command`` run where ``folder`` is a read-only mount: a bind mount in a mount namespace
    of its own, so for this process (a live writer, say) ``folder`` stays writable."""
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    return subprocess.run(["unshare", "--mount", "sh", "-c", script, str(folder), *command],
                          cwd=HERE, capture_output=True, text=True, timeout=60)


def kit_where_read_only(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return where_read_only(folder, sys.executable, "-m", "kit_cli", *args)


async def test_a_log_on_a_read_only_mount_is_read_closed_or_live_and_left_as_it_is(tmp_path):
    try:
        probe = where_read_only(tmp_path, "sh", "-c", 'touch "$0/probe"', str(tmp_path))
    except FileNotFoundError:
        pytest.skip("no unshare(1) here to make a read-only mount")
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"cannot make a read-only mount here (needs CAP_SYS_ADMIN): {probe.stderr}")
    db = tmp_path / "kit.db"
    run_id, url = await logged(db), f"sqlite:///{db}"
    before = db.read_bytes()
    listed = await anyio.to_thread.run_sync(kit_where_read_only, tmp_path, "runs", "list",
                                            "--json", "--store", url)
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["run_id"] for line in listed.stdout.splitlines()] == [run_id]
    events = await anyio.to_thread.run_sync(kit_where_read_only, tmp_path, "runs", "events",
                                            run_id, "--store", url)
    assert [json.loads(line)["kind"] for line in events.stdout.splitlines()] == ["run.started"]
    signal = await anyio.to_thread.run_sync(kit_where_read_only, tmp_path, "runs", "signal",
                                            run_id, "cancel", "--store", url)
    assert signal.returncode == 1 and signal.stderr.startswith(f"kit: {db}: "), signal.stderr
    assert db.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["kit.db"]

    # Live: a writer here holds the log open, its last commits in the WAL only; the reader on
    # the read-only mount takes the writer's index and sees them.
    async with SQLiteStore(db) as writer:
        await writer.append([kit.Event(run_id, 1, kit.RunCompleted("ok"), "a")])
        assert (tmp_path / "kit.db-wal").stat().st_size > 0
        events = await anyio.to_thread.run_sync(kit_where_read_only, tmp_path, "runs", "events",
                                                run_id, "--store", url)
        assert [json.loads(line)["kind"] for line in events.stdout.splitlines()] == [
            "run.started", "run.completed"], events.stderr
        listed = await anyio.to_thread.run_sync(kit_where_read_only, tmp_path, "runs", "list",
                                                "--store", url)
        assert listed.returncode == 0 and "COMPLETED" in listed.stdout, listed.stderr
        # What a crash leaves (a -wal, no -shm) cannot be read there: said, not a wrong page.
        for suffix in ("", "-wal"):
            shutil.copy(f"{db}{suffix}", tmp_path / f"crashed.db{suffix}")
    listed = await anyio.to_thread.run_sync(kit_where_read_only, tmp_path, "runs", "list",
                                            "--store", f"sqlite:///{tmp_path / 'crashed.db'}")
    assert listed.returncode == 1 and listed.stdout == "", listed
    assert f"{tmp_path}/crashed.db-wal holds commits not yet in" in listed.stderr


async def test_a_postgres_role_that_may_only_select_reads_the_log(postgres_url):
    import psycopg
    from kit_pgpool import pg_url
    conninfo, schema = pg_url(postgres_url)
    async with store_from_url(postgres_url) as store:
        await store.append([kit.Event("r1", 0, kit.RunStarted("a", "agent", "s1", None, ()), "a")])
    role = f"kit_reader_{schema[5:]}"
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}")
    try:
        url = postgres_url.replace("postgres@", f"{role}@")
        ran = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--json", "--store", url)
        assert ran.returncode == 0 and json.loads(ran.stdout)["run_id"] == "r1", ran.stderr
        ran = await anyio.to_thread.run_sync(kit_cli, "runs", "events", "r1", "--store", url)
        assert ran.returncode == 0 and json.loads(ran.stdout)["kind"] == "run.started"
        ran = await anyio.to_thread.run_sync(kit_cli, "runs", "signal", "r1", "pause",
                                             "--store", url)
        assert ran.returncode == 1 and "permission denied" in ran.stderr, ran.stderr
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
    async with store_from_url(postgres_url) as store:
        assert await store.requests() == []


async def test_a_postgres_schema_without_a_log_is_refused_and_not_created(postgres_url):
    import psycopg
    from kit_pgpool import pg_url
    conninfo, schema = pg_url(postgres_url)
    for args in (["runs", "list"], ["runs", "events", "r1"], ["runs", "signal", "r1", "cancel"]):
        ran = await anyio.to_thread.run_sync(kit_cli, *args, "--store", postgres_url)
        assert (ran.returncode, ran.stdout) == (1, ""), ran
        assert f"schema '{schema}' holds no kit event log" in ran.stderr
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s",
                            (schema,)).fetchone() is None
