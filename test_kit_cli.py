"""Tests of the ``kit`` console script against a real log file."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass

import anyio
import pytest

import kit
import kit_cli as cli
from kit_store import SQLiteStore

pytestmark = pytest.mark.anyio


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


async def test_runs_list_reads_the_log(tmp_path):
    db = tmp_path / "kit.db"
    async with SQLiteStore(db) as store:
        model = kit.ScriptedModel(["hi", RuntimeError("down")])
        async with kit.Deck([kit.Agent("greeter", model=model)], store=store) as deck:
            ok = await deck.run("greeter", "hello", session_id="s1")
            with pytest.raises(RuntimeError):
                await deck.run("greeter", "again", session_id="s2")
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", f"sqlite:///{db}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(ok.run_id) and "COMPLETED" in lines[0]
    assert "FAILED" in lines[1] and "s2" in lines[1]
    out = await anyio.to_thread.run_sync(kit_cli, "runs", "list", "--store", f"sqlite:///{db}",
                                         "--status", "FAILED", "--json")
    [row] = [json.loads(line) for line in out.stdout.splitlines()]
    assert (row["status"], row["name"], row["session_id"]) == ("FAILED", "greeter", "s2")


def test_usage_errors_exit_2_and_a_missing_log_exits_1(tmp_path, monkeypatch):
    monkeypatch.delenv("KIT_STORE", raising=False)
    out = kit_cli("runs", "list")
    assert out.returncode == 2 and "--store" in out.stderr
    out = kit_cli("runs", "list", "--store", "mysql://x")
    assert out.returncode == 2 and "mysql://x" in out.stderr
    out = kit_cli("runs", "frobnicate")
    assert out.returncode == 2
    out = kit_cli("runs", "list", "--store", f"sqlite:///{tmp_path}/none.db")
    assert out.returncode == 1 and "no event log" in out.stderr
    assert not (tmp_path / "none.db").exists()
