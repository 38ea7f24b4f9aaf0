"""The shape of the tree: imports point one way, down the layers; no module reaches another's
private names; every module declares its surface; ``import kit`` loads no engine SDK."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: From the ground floor up (README "Architecture"): a module imports only modules before it.
LAYERS = ("kit_errors", "kit_content", "kit_checks", "kit_ports", "kit_core", "kit_storebase", "kit_store", "kit_writer", "kit_bridge", "kit_pgpool", "kit_pg", "kit_context", "kit_scripted", "kit_prices", "kit_sessions", "kit_mcp_servers", "kit_tools", "kit_agents",
          "kit_threads", "kit_workflows", "kit_catalog", "kit_otlp", "kit_tracing", "kit_observers", "kit_runs",
          "kit_control", "kit_runtime",
          "kit_openai", "kit_mcp", "kit_guard", "kit_openapi", "kit_playground", "kit_sse", "kit_request", "kit_hypercorn", "kit_http",
          "kit_serve", "kit", "kit_cli")


def _module_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(HERE.glob("kit*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, known: set[str]) -> set[str]:
    """Sibling modules a module imports anywhere (lazy imports in functions count), except in
    ``if TYPE_CHECKING:`` blocks and in a console entry point's ``def main()``."""
    found: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, ast.FunctionDef) and child.name == "main" and node is tree:
                continue
            if isinstance(child, ast.Import):
                found.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module.split(".")[0])
            walk(child)

    walk(tree)
    return found & known


def test_every_module_has_a_layer():
    assert set(_module_files()) == set(LAYERS)


def test_every_module_is_installed():
    """pyproject's ``py-modules`` names every module: one it misses works in a checkout (the
    tests run beside it) and is missing from every install (``kit-serve`` elsewhere fails)."""
    import tomllib
    project = tomllib.loads((HERE / "pyproject.toml").read_text())
    assert set(project["tool"]["setuptools"]["py-modules"]) == set(_module_files())


def test_imports_point_down_the_layers_and_never_in_a_circle():
    files = _module_files()
    graph = {name: _imports(ast.parse(path.read_text()), set(files)) - {name}
             for name, path in files.items()}
    assert graph["kit_errors"] == set(), "kit_errors imports no sibling"
    assert graph["kit_content"] == {"kit_errors"}, "kit_content imports only kit_errors"
    assert graph["kit_checks"] == {"kit_errors"}, "kit_checks imports only kit_errors"
    assert graph["kit_ports"] == set(), "kit_ports imports no sibling at run time"
    assert graph["kit_core"] == {"kit_errors", "kit_content", "kit_checks", "kit_ports"}, \
        "kit_core imports only the floor below"
    for name, deps in graph.items():
        above = {d for d in deps if LAYERS.index(d) > LAYERS.index(name)}
        assert not above, f"{name} imports {sorted(above)}, which sit above it"
    # No cycle, whatever LAYERS says: a depth-first walk finds no back edge.
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path + [node, dep])
            if dep not in state:
                visit(dep, path + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_no_module_touches_another_modules_private_names():
    files = _module_files()
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in files:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports {private} from {node.module}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in files and node.value.id != name:
                assert not node.attr.startswith("_") or node.attr.startswith("__"), \
                    f"{name} reaches {node.value.id}.{node.attr}"


@pytest.mark.parametrize("name", LAYERS)
def test_every_module_declares_its_surface_and_its_rules(name):
    module = __import__(name)
    assert isinstance(module.__all__, tuple) and len(set(module.__all__)) == len(module.__all__)
    for public in module.__all__:
        assert hasattr(module, public), f"{name}.__all__ names {public}, which it lacks"
    doc = module.__doc__ or ""
    assert "Owns:" in doc and "Must never:" in doc, f"{name} opens without its rules"


def test_import_kit_loads_no_engine_sdk():
    code = ("import sys, kit; kit.Agent, kit.Workflow, kit.TextBlock, kit.Deck; "
            "print(sorted(m for m in ('agents', 'langgraph', 'openai', 'kit_runtime', 'kit_agents', "
            "'kit_workflows') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    code = "import kit; print(kit.ScriptedModel.__module__)"  # loaded on first use
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "kit_scripted", out.stderr



_PLAY = """
import os, sys, anyio, kit
os.environ["KIT_STORE"] = "memory"
{define}
async def main():
    async with kit.Deck({catalog}) as deck:
        print(repr(await deck.run({name!r}, {input!r})))
    print(sorted(m for m in ("agents", "openai", "mcp", "langgraph", "langchain_core") if m in sys.modules))
anyio.run(main)
"""
_GRAPH = """
from typing import TypedDict
from langgraph.graph import StateGraph
class S(TypedDict):
    n: int
graph = StateGraph(S).add_node("add", lambda s: {"n": s["n"] + 1})
graph = graph.set_entry_point("add").set_finish_point("add")
"""


@pytest.mark.parametrize("define, catalog, name, input, expected, loaded", [
    (_GRAPH, "workflows=[kit.Workflow('count', graph)]", "count", {"n": 1}, "{'n': 2}",
     ["langchain_core", "langgraph"]),
    ("", "agents=[kit.Agent('hi', 'x', model=kit.ScriptedModel(['hello']))]", "hi", "hey",
     "'hello'", ["agents", "mcp", "openai"]),
], ids=["workflow-only", "agent-only"])
def test_a_deck_loads_only_the_engine_it_plays(define, catalog, name, input, expected, loaded):
    """A workflow-only deck never imports the agents SDK (~1.4 s, ~45 MB to import), nor an
    agent-only deck LangGraph."""
    code = _PLAY.format(define=define, catalog=catalog, name=name, input=input)
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result, modules = out.stdout.strip().splitlines()
    assert expected in result
    assert modules == repr(loaded)
