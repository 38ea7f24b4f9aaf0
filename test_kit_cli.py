"""Tests of the ``kit`` console script against a real log file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kit
from kit_store import SQLiteStore

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent


def kit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kit_cli", *args], cwd=HERE, capture_output=True,
                          text=True, timeout=60)


async def test_runs_list_reads_the_log(tmp_path):
    db = tmp_path / "kit.db"
    async with SQLiteStore(db) as store:
        model = kit.ScriptedModel(["hi", RuntimeError("down")])
        async with kit.Deck([kit.Agent("greeter", model=model)], store=store) as deck:
            ok = await deck.run("greeter", "hello", session_id="s1")
            with pytest.raises(RuntimeError):
                await deck.run("greeter", "again", session_id="s2")
    out = kit_cli("runs", "list", "--store", f"sqlite:///{db}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(ok.run_id) and "COMPLETED" in lines[0]
    assert "FAILED" in lines[1] and "s2" in lines[1]
    out = kit_cli("runs", "list", "--store", f"sqlite:///{db}", "--status", "FAILED", "--json")
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
