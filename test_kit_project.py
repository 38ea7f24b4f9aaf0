"""Tests of Deck.from_project: discovery, failures named by file, the project's own log file,
and the example project in this repository (asyncio and trio)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

import kit
from kit import ConfigError, Deck
from kit_store import SQLiteStore

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent

AGENT = '''
import kit
agent = kit.Agent("{name}", model=kit.ScriptedModel(["hello from {name}"], cycle=True))
'''


def project(tmp_path: Path, bundles: dict[str, str]) -> Path:
    root = tmp_path / "proj"
    for rel, source in bundles.items():
        file = root / rel
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(source)
    root.mkdir(exist_ok=True)
    return root


async def test_discovers_bundles_and_keeps_its_log_in_the_project(tmp_path, monkeypatch):
    monkeypatch.delenv("KIT_STORE", raising=False)
    root = project(tmp_path, {"agents/b/agent.py": AGENT.format(name="bee"),
                              "agents/a/agent.py": AGENT.format(name="ant")})
    path_before = list(sys.path)
    async with Deck.from_project(root) as deck:
        assert list(deck.agents) == ["ant", "bee"]
        result = await deck.run("bee", "hi")
    assert sys.path == path_before  # bundles load from their files
    async with SQLiteStore(root / ".state" / "kit.db") as store:
        assert (await store.read(result.run_id))[-1].payload.output == "hello from bee"


@pytest.mark.parametrize("source, match", [
    ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
    ("raise RuntimeError('boom')\n", "boom"),
    ("import sys\nsys.exit(2)\n", "SystemExit"),  # argparse at import: it exited kit-serve
    ("agent = 42\n", "module-level 'agent'"),
])
def test_a_broken_bundle_is_a_config_error_naming_its_file(tmp_path, source, match):
    root = project(tmp_path, {"agents/bad/agent.py": source})
    with pytest.raises(ConfigError, match=match) as err:
        Deck.from_project(root)
    assert str(root / "agents" / "bad" / "agent.py") in str(err.value)


async def test_a_second_live_project_deck_names_both_projects(tmp_path):
    first = Deck.from_project(project(tmp_path / "one", {"agents/a/agent.py": AGENT.format(name="ant")}))
    try:
        second = project(tmp_path / "two", {"agents/b/agent.py": AGENT.format(name="bee")})
        with pytest.raises(ConfigError) as err:
            Deck.from_project(second)
        message = str(err.value)
        assert str((tmp_path / "one" / "proj").resolve()) in message
        assert str(second.resolve()) in message and "kit.py" not in message
    finally:
        await first.aclose()


async def test_a_projects_agents_and_deck_take_a_history_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_STORE", "memory")
    limited = 'import kit\nagent = kit.Agent("ant", model=kit.ScriptedModel(["r"], cycle=True), history_limit=1)\n'
    root = project(tmp_path, {"agents/a/agent.py": limited, "agents/b/agent.py": AGENT.format(name="bee")})
    async with Deck.from_project(root, history_limit=3) as deck:
        for name in ("ant", "bee"):
            for n in (1, 2, 3):
                await deck.run(name, f"t{n}", session_id=name)
        assert len(deck.agents["ant"].model.calls[-1]["input"]) == 2  # its own: 1 item, then t3
        assert len(deck.agents["bee"].model.calls[-1]["input"]) == 4  # the deck's: 3, then t3
    monkeypatch.setenv("KIT_HISTORY_LIMIT", "2")  # kit-serve's way: the setting, unless passed
    for passed, sent in ((None, 3), (1, 2)):
        async with Deck.from_project(root, history_limit=passed) as deck:
            for n in (1, 2, 3):
                await deck.run("bee", f"t{n}", session_id="bee")
            assert len(deck.agents["bee"].model.calls[-1]["input"]) == sent
            assert len(deck.agents["ant"].model.calls) == 0
    for bad in ("0", "-1", "ten", "2.5"):
        monkeypatch.setenv("KIT_HISTORY_LIMIT", bad)
        deck = Deck.from_project(root)
        with pytest.raises(ConfigError, match=rf"KIT_HISTORY_LIMIT must be a positive integer, got '{bad}'"):
            deck.build()
        await deck.aclose()


FUTURE_AGENT = '''
from __future__ import annotations
import dataclasses
import kit

@dataclasses.dataclass
class Settings:
    greeting: str = "hello"

agent = kit.Agent("dc", model=kit.ScriptedModel([Settings().greeting], cycle=True))
'''
FUTURE_WORKFLOW = '''
from __future__ import annotations
import operator
from typing import Annotated, TypedDict
from langgraph.graph import END, START, StateGraph
import kit

class State(TypedDict):
    log: Annotated[list[str], operator.add]

graph = StateGraph(State)
graph.add_node("a", lambda state: {"log": ["a"]})
graph.add_edge(START, "a").add_edge("a", END)
workflow = kit.Workflow("wf", graph)
'''


async def test_bundles_load_as_modules_do_under_future_annotations(tmp_path, monkeypatch):
    """A dataclass, and a TypedDict state's hints, are resolved through sys.modules."""
    monkeypatch.setenv("KIT_STORE", "memory")
    root = project(tmp_path, {"agents/dc/agent.py": FUTURE_AGENT,
                              "workflows/wf/workflow.py": FUTURE_WORKFLOW})
    async with Deck.from_project(root) as deck:
        assert (await deck.run("dc", "hi")).output == "hello"
        assert await deck.run("wf", {"log": []}) == {"log": ["a"]}


async def test_a_bundle_imports_its_own_files_relatively(tmp_path, monkeypatch):
    """`from . import prompts` in agent.py failed: attempted relative import with no known parent
    package. Another project's bundle of the same name keeps its own prompts."""
    monkeypatch.setenv("KIT_STORE", "memory")
    source = ("import kit\nfrom . import prompts\nfrom .prompts import REPLY\n"
              "agent = kit.Agent('ant', model=kit.ScriptedModel([REPLY]))\n")
    for reply in ("one", "two"):
        root = project(tmp_path / reply, {"agents/a/agent.py": source,
                                          "agents/a/prompts.py": f"REPLY = {reply!r}\n"})
        async with Deck.from_project(root) as deck:
            assert (await deck.run("ant", "hi")).output == reply


async def test_a_bundle_with_a_dot_in_its_name_imports_its_own_files_relatively(tmp_path, monkeypatch):
    """agents/chat.v2/agent.py doing `from . import prompts` failed to import: "No module named
    'kit_project_agents_chat'" (its module's dotted name made Python look for a parent package
    that no bundle is)."""
    monkeypatch.setenv("KIT_STORE", "memory")
    root = project(tmp_path, {
        "agents/chat.v2/agent.py": ("import kit\nfrom . import prompts\n"
                                    "agent = kit.Agent('chat', model=kit.ScriptedModel("
                                    "[prompts.REPLY]))\n"),
        "agents/chat.v2/prompts.py": "REPLY = 'from v2'\n"})
    async with Deck.from_project(root) as deck:
        assert (await deck.run("chat", "hi")).output == "from v2"


def test_python_no_bundle_loads_is_a_warning_naming_it(tmp_path, caplog):
    """agents/chat.py (no bundle directory) or agents/chat/agents.py (a misnamed file) left the
    deck without the agent, and kit-serve served it, in silence."""
    root = project(tmp_path, {"agents/a/agent.py": AGENT.format(name="ant"),
                              "agents/a/prompts.py": "", "agents/__init__.py": "",
                              "agents/chat.py": AGENT.format(name="chat"),
                              "workflows/flow/workflows.py": ""})
    with caplog.at_level("WARNING", logger="kit.project"):
        deck = Deck.from_project(root)
    anyio.run(deck.aclose)
    assert list(deck.agents) == ["ant"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{root / 'agents' / 'chat.py'} is not loaded: a bundle is agents/<bundle>/agent.py "
        "defining 'agent'",
        f"{root / 'workflows' / 'flow'} is not loaded: a bundle is workflows/<bundle>/workflow.py "
        "defining 'workflow'"]


def test_what_would_be_skipped_or_hang_is_a_config_error_naming_the_file(tmp_path):
    root = project(tmp_path, {"agents/a/agent.py": AGENT.format(name="ant")})
    looped = root / "agents" / "loop" / "agent.py"
    looped.parent.mkdir()
    looped.symlink_to(looped)  # glob skipped it: the deck was served without the agent
    with pytest.raises(ConfigError, match=f"^{looped} is a symlink that leads to no file$"):
        Deck.from_project(root)
    looped.unlink()
    os.mkfifo(looped)  # reading it would wait for a writer for ever
    with pytest.raises(ConfigError, match=f"^{looped} is not a regular file$"):
        Deck.from_project(root)
    looped.unlink()
    looped.write_text(AGENT.format(name="ant"))
    with pytest.raises(ConfigError, match=f"^{root / 'agents' / 'a' / 'agent.py'} and {looped} "
                                          "both define 'ant'"):
        Deck.from_project(root)
    looped.write_text("import kit\nagent = kit.Agent('bee', skills='release-notes')\n")
    with pytest.raises(ConfigError, match="skills takes a list, got the string 'release-notes'"):
        Deck.from_project(root)


def test_a_missing_project_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no kit project"):
        Deck.from_project(tmp_path / "nowhere")
    # an unset setting (os.environ.get(...)): "expected str, bytes or os.PathLike object"
    for path in (None, 5, b"/tmp"):
        with pytest.raises(ConfigError, match=rf"from_project\(path=...\) takes a directory's "
                                              rf"path \(a str or a Path\), got {type(path).__name__}"):
            Deck.from_project(path)


async def test_the_example_project_runs_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("KIT_STORE", f"sqlite:///{tmp_path / 'example.db'}")
    async with Deck.from_project(HERE / ".kit") as deck:
        assert (list(deck.agents), list(deck.workflows)) == (["chat"], ["approval"])
        reply = await deck.run("chat", "what time is it?")
        assert "clock tool" in reply.output
        parked = await deck.run("approval", {"title": "v1"}, session_id="rel-1")
        assert isinstance(parked, kit.InterruptResult)
        [pending] = await deck.pending()
        final = await deck.answer(pending.run_id, "yes")
        assert final["log"][-1] == "published"
