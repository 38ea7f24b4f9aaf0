"""Tests of skills: SKILL.md validation, the catalog in an agent's instructions, the generated
load_skill tool and its skill.loaded events, project discovery and /health (asyncio and trio)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import anyio
import pytest

import kit
from kit import Agent, ConfigError, Deck, ScriptedModel, Skills
from kit_store import MemoryStore
from test_kit_http import served

pytestmark = pytest.mark.anyio
HERE = Path(__file__).parent

NOTES = """---
name: release-notes
description: >-
  Writes release notes from a list of changes. Use it when asked to announce a release.
license: MIT
metadata:
  author: kit
---
# Release notes

Group the changes under Added, Changed and Fixed.
"""
BODY = "# Release notes\n\nGroup the changes under Added, Changed and Fixed."


def skill(root: Path, dirname: str, text: str) -> Path:
    (root / dirname).mkdir(parents=True, exist_ok=True)
    (root / dirname / "SKILL.md").write_text(text, encoding="utf-8")
    return root / dirname


def front(name: str, description: str = "Does a thing. Use it for things.") -> str:
    return f"---\nname: {name}\ndescription: {description}\n---\nBody of {name}.\n"


@pytest.fixture
async def store():
    async with MemoryStore() as s:
        yield s


@pytest.fixture
def skills_dir(tmp_path):
    root = tmp_path / "skills"
    skill(root, "release-notes", NOTES)
    skill(root, "triage", front("triage", "Sorts bug reports. Use it on new issues."))
    skill(root, "secret", front("secret", "Not for the agent under test."))
    return root


# ------------------------------------------------------------------------- validation ----

def test_a_valid_catalog_from_a_directory_a_skill_or_a_sequence(skills_dir):
    catalog = Skills(skills_dir)
    assert list(catalog) == ["release-notes", "secret", "triage"]
    notes = catalog["release-notes"]
    assert notes.description == ("Writes release notes from a list of changes. Use it when asked "
                                 "to announce a release.")
    assert notes.body == BODY and notes.path == skills_dir / "release-notes" / "SKILL.md"
    assert list(Skills(skills_dir / "triage")) == ["triage"]
    assert list(Skills([skills_dir / "triage", str(skills_dir / "secret")])) == ["triage", "secret"]
    assert len(Skills()) == 0


@pytest.mark.parametrize("dirname, text, match", [
    ("a", "no front matter\n", "must open with YAML front matter"),
    ("a", "---\nname: a\ndescription: x\n", "must open with YAML front matter"),
    ("a", "---\nname: [a\n---\n", "not valid YAML"),
    # One line, and the file's own line (the YAML error counted from the front matter's first)
    ("a", "---\nname: a\ndescription: Use it: when asked\n---\n",
     r"SKILL.md, line 3 column 20: the front matter is not valid YAML: mapping values are not "
     r"allowed here$"),
    ("a", "---\n- a\n- b\n---\n", "must be a mapping"),
    # PyYAML kept the last of a key written twice: the first description vanished in silence
    ("a", "---\nname: a\ndescription: d\ndescription: e\n---\n",
     r"SKILL.md, line 4 column 1: the front matter is not valid YAML: the key 'description' is "
     r"written twice$"),
    ("a", "---\nname: a\ndescription: d\nmetadata: {v: '1', v: '2'}\n---\n", "'v' is written twice"),
    ("a", front("b"), "must equal its directory's name 'a'"),
    ("Bad", front("Bad"), "lowercase letters"),
    ("a--b", front("a--b"), "single hyphens"),
    ("-a", front("-a"), "not starting or ending"),
    ("a-", front("a-"), "not starting or ending"),
    ("a" * 65, front("a" * 65), "1-64 characters"),
    ("a", "---\nname: a\n---\n", "description is required"),
    ("a", "---\nname: a\ndescription: ''\n---\n", "description is required"),
    ("a", front("a", "d" * 1025), "1-1024 characters"),
    ("a", "---\nname: a\ndescription: d\ncompatibility: " + "c" * 501 + "\n---\n", "compatibility"),
    ("a", "---\nname: a\ndescription: d\nmetadata: [n, 1]\n---\n", "metadata"),
    ("a", "---\nname: a\ndescription: d\nmetadata: {n: {m: 1}}\n---\n", "metadata"),
    ("a", "---\nname: a\ndescription: !!python/object/apply:os.getpid []\n---\n", "description is"),
    ("a", "---\nname: " + "[" * 50_000 + "]" * 50_000 + "\n---\n", "nested too deeply"),
])
def test_a_bad_skill_md_is_a_config_error_naming_the_file(tmp_path, dirname, text, match):
    path = skill(tmp_path, dirname, text)
    with pytest.raises(ConfigError, match=match) as err:
        Skills(tmp_path)
    assert str(path / "SKILL.md") in str(err.value)


def test_front_matter_values_are_text_as_written(tmp_path):
    """YAML 1.1 would read these as a date, an int, a bool and a float, and refuse valid skills
    (or a whole project): the spec's reference parser (strictyaml) reads every value as text."""
    for dirname, description in (("2024-01-01", "Yes"), ("010", "12:30"), ("on", "null")):
        skill(tmp_path / dirname, dirname, f"---\nname: {dirname}\ndescription: {description}\n"
              "metadata:\n  version: 1.0\n  stable: true\n---\nBody.\n")
        catalog = Skills(tmp_path / dirname)
        assert list(catalog) == [dirname] and catalog[dirname].description == description
    assert list(Skills(skill(tmp_path / "e", "e", "---\nname: e\ndescription: d\nmetadata:\n---\n")))


def test_a_skill_read_from_inside_its_directory_has_its_directory_name(tmp_path, monkeypatch):
    """``Skills(".")`` in the skill's own directory: its name was compared with ''."""
    monkeypatch.chdir(skill(tmp_path, "triage", front("triage")))
    assert list(Skills(".")) == ["triage"] and list(Skills(Path("../triage/."))) == ["triage"]


def test_size_duplicates_and_missing_paths_are_refused(tmp_path):
    big = skill(tmp_path / "one", "big", front("big") + "x" * kit.MAX_SKILL_BYTES)
    with pytest.raises(ConfigError, match="larger than") as err:
        Skills(big)
    assert str(big / "SKILL.md") in str(err.value)
    first, second = skill(tmp_path / "p", "s", front("s")), skill(tmp_path / "q", "s", front("s"))
    with pytest.raises(ConfigError, match="two skills are named 's'"):
        Skills([first, second])
    with pytest.raises(ConfigError, match="no skills at"):
        Skills(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="no skills at"):
        Deck(skills=tmp_path / "nowhere")


def test_a_skill_md_that_cannot_be_read_is_named_not_skipped(tmp_path):
    """A looping symlink was skipped by the directory scan: the agent then named an 'unknown
    skill'; a FIFO would hang the read."""
    path = tmp_path / "s" / "SKILL.md"
    path.parent.mkdir()
    path.symlink_to(path)
    with pytest.raises(ConfigError, match=f"^{path} is a symlink that leads to no file$"):
        Skills(tmp_path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ConfigError, match=f"^{path} is not a regular file$"):
        Skills(tmp_path)
    with pytest.raises(ConfigError, match=f"^{path} is not a regular file$"):
        Skills(path.parent)


def test_a_directory_that_holds_no_skill_md_is_named_not_skipped_in_silence(skills_dir, caplog):
    """A group of skills one level deeper, or a skill.md in lower case, is no skill: the agent
    naming one learned only of an 'unknown skill'."""
    skill(skills_dir / "group", "inner", front("inner"))
    (skills_dir / "lower").mkdir()
    (skills_dir / "lower" / "skill.md").write_text(front("lower"))
    for quiet in (".git", "__pycache__"):
        (skills_dir / quiet).mkdir()
    with caplog.at_level("WARNING", logger="kit.project"):
        assert sorted(Skills(skills_dir)) == ["release-notes", "secret", "triage"]
    assert [r.getMessage() for r in caplog.records if r.name == "kit.project"] == [
        f"{skills_dir / d} is not loaded: a skill is {skills_dir}/<skill>/SKILL.md"
        for d in ("group", "lower")]


def test_build_refuses_a_skill_the_deck_does_not_have(skills_dir):
    deck = Deck([Agent("a", skills=["release-notes", "nope"])], skills=skills_dir)
    known = "release-notes, secret, triage"
    with pytest.raises(ConfigError, match=rf"unknown skill 'nope' \(the deck has: {known}\)"):
        deck.build()
    anyio.run(deck.aclose)


# ------------------------------------------------------------------------- load_skill ----

async def test_load_skill_serves_the_body_and_logs_its_sha256(skills_dir, store):
    model = ScriptedModel([{"tool": "load_skill", "args": {"name": "release-notes"}}, "Noted."])
    agent = Agent("writer", "You write.", model=model, skills=["release-notes", "triage"])
    async with Deck([agent], skills=[skills_dir], store=store) as deck:
        assert list(deck.skills) == ["release-notes", "secret", "triage"]
        events = [e async for e in deck.stream("writer", "announce v2")]
    instructions = model.calls[0]["instructions"]
    assert instructions.startswith("You write.\n\n## Skills\n")
    assert ("- release-notes: Writes release notes from a list of changes. Use it when asked to "
            "announce a release.") in instructions
    assert "- triage: Sorts bug reports." in instructions and "secret" not in instructions
    assert "load_skill" in model.calls[0]["tools"]
    [served] = [i for i in model.calls[-1]["input"] if i.get("type") == "function_call_output"]
    assert served["output"] == BODY
    kinds = [e.kind for e in events]
    assert kinds[kinds.index("tool.started"):kinds.index("tool.completed") + 1] == [
        "tool.started", "skill.loaded", "tool.completed"]
    [loaded] = [e.payload for e in events if e.kind == "skill.loaded"]
    assert loaded == kit.SkillLoaded("release-notes", hashlib.sha256(BODY.encode()).hexdigest())
    [done] = [e.payload for e in events if e.kind == "tool.completed"]
    assert (done.tool, done.output, done.is_error) == ("load_skill", BODY, False)


@pytest.mark.parametrize("name, why", [("../x", "never carry a path"),
                                       ("../secret", "never carry a path"),
                                       ("secret", "no such skill for this agent")])
async def test_load_skill_refuses_names_outside_the_agents_skills(skills_dir, store, name, why):
    model = ScriptedModel([{"tool": "load_skill", "args": {"name": name}}, "ok"])
    agent = Agent("writer", model=model, skills=["release-notes"])
    async with Deck([agent], skills=skills_dir, store=store) as deck:
        result = await deck.run("writer", "go")
        events = await store.read(result.run_id)
    assert "skill.loaded" not in [e.kind for e in events]
    [done] = [e.payload for e in events if e.kind == "tool.completed"]
    assert done.is_error and done.output.startswith("error: refused") and why in done.output
    assert "Not for the agent" not in json.dumps(list(model.calls[-1]["input"]))


async def test_callable_instructions_get_the_catalog_too(skills_dir, store):
    def instructions(ctx: kit.Context, agent) -> str:
        return f"Serve {ctx.data}."

    model = ScriptedModel(["hi"])
    agent = Agent("writer", instructions, model=model, skills=["triage"])
    async with Deck([agent], skills=Skills(skills_dir), store=store) as deck:
        await deck.run("writer", "go", context="alice")
    assert model.calls[0]["instructions"].startswith("Serve alice.\n\n## Skills\n")
    assert "- triage: Sorts bug reports. Use it on new issues." in model.calls[0]["instructions"]


# ---------------------------------------------------------------- project and /health ----

async def test_from_project_discovers_skills_and_health_lists_them(tmp_path, store):
    root = tmp_path / "proj"
    skill(root / "skills", "triage", front("triage"))
    skill(root / "skills", "release-notes", NOTES)
    (root / "agents" / "a").mkdir(parents=True)
    (root / "agents" / "a" / "agent.py").write_text(
        "import kit\nagent = kit.Agent('a', model=kit.ScriptedModel(['x'], cycle=True), "
        "skills=['triage'])\n")
    deck = Deck.from_project(root, store=store)
    assert list(deck.skills) == ["release-notes", "triage"]
    async with served(deck) as (client, _):
        health = await client.get("/health")
    assert health.json() == {"status": "ok", "agents": ["a"], "workflows": [],
                             "skills": ["release-notes", "triage"]}


def test_the_example_project_has_a_skill_its_chat_agent_uses():
    deck = Deck.from_project(HERE / ".kit")
    try:
        assert "release-notes" in deck.skills and "release-notes" in deck.agents["chat"].skills
        deck.build()
    finally:
        anyio.run(deck.aclose)

