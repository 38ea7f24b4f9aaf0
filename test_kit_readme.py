"""The README's code runs as written: every fenced block marked ```` ```python runnable ```` is
executed, offline (ScriptedModel), in an empty directory, with no kit setting in the environment.
And its tables say what the code has: every public name of ``kit``, every module in its layer,
exactly the settings kit reads, every route served (and only those), every command-line option."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parent / "README.md"
#: The sections whose examples a newcomer copies first: each must keep a runnable block.
MUST_RUN = ("Quickstart", "Workflows", "Skills and MCP tool servers", "Observers and tracing")


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(section, line number, source) of every ```` ```python runnable ```` block."""
    blocks, section, source, start = [], "", None, 0
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if source is not None:
            if line.startswith("```"):
                blocks.append((section, start, "\n".join(source) + "\n"))
                source = None
            else:
                source.append(line)
        elif line.startswith("## "):
            section = line[3:].strip()
        elif re.fullmatch(r"```python\s+runnable\s*", line):
            source, start = [], number + 1
    return blocks


BLOCKS = runnable_blocks()


def test_the_first_examples_are_marked_runnable():
    assert set(MUST_RUN) <= {section for section, _, _ in BLOCKS}


@pytest.mark.parametrize("section, line, source", BLOCKS, ids=[f"{s} (line {n})" for s, n, _ in BLOCKS])
def test_a_runnable_block_runs_as_written(section, line, source, tmp_path, monkeypatch, capsys):
    for name in ("KIT_STORE", "KIT_SESSION", "KIT_PROJECT", "KIT_MODEL", "KIT_OPENAI_API",
                 "KIT_TRACING_PUBLIC_KEY", "KIT_TRACING_SECRET_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    # dont_inherit: this file's `from __future__ import annotations` must not reach the block
    exec(compile(source, f"{README}:{line}", "exec", dont_inherit=True), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip(), f"the {section} example prints what it shows"


# ----------------------------------------------------------- README's tables against the code --
CODE = {p.stem: p.read_text() for p in sorted(README.parent.glob("kit*.py"))}


def section(title: str) -> str:
    """The text of README's ``## <title>`` section, up to the next ``## ``."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def first_column(text: str) -> list[str]:
    """The first cell of each row of the Markdown tables in ``text`` (header and rule left out)."""
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows if r not in ("variable", "module", "route") and set(r) != {"-"}]


def test_every_public_name_is_documented():
    import kit
    text = README.read_text()
    missing = [n for n in kit.__all__ if not re.search(rf"(?<!\w){re.escape(n)}\b", text)]
    assert not missing, f"kit.__all__ names README never mentions: {missing}"


def test_the_architecture_table_lists_every_module_in_layer_order():
    from test_kit_layout import LAYERS
    modules = [re.sub(r"`(\w+)\.py`", r"\1", cell) for cell in first_column(section("Architecture"))]
    assert modules == list(LAYERS)


def test_the_settings_table_lists_exactly_the_settings_kit_reads():
    # a setting is read by its name, as a string; a module constant's name in __all__ is not one
    read = {name for module, src in CODE.items()
            for name in re.findall(r"[\"']((?:KIT_[A-Z_]+|HOST|PORT))[\"']", src)
            if not re.search(rf"^{name}\s*=", src, re.M)}
    listed = {name for cell in first_column(section("Settings"))
              for name in re.findall(r"`([A-Z_]+)`", cell)}
    assert listed == read, (f"read but not listed: {sorted(read - listed)}; "
                            f"listed but never read: {sorted(listed - read)}")


def test_every_route_is_documented_and_every_documented_route_is_served():
    import kit_http
    text = " ".join(README.read_text().split())  # a route's method and path may wrap a line
    served = {(method, path) for method, path, *_ in kit_http._ROUTES}
    undocumented = sorted(f"{m} {p}" for m, p in served if f"`{m} {p}`" not in text)
    assert not undocumented, f"routes README never names: {undocumented}"
    table = section("HTTP and SSE").split("\n| route |", 1)[1].split("\n\n", 1)[0]
    for cell in first_column("| route |" + table):
        for method, path in re.findall(r"`(GET|POST) ([^`?]+)(?:\?[^`]*)?`", cell):
            assert (method, path) in served, f"README's route table shows {method} {path}"


def test_every_command_line_option_is_documented():
    text = README.read_text()
    for module in ("kit_cli", "kit_serve"):
        options = re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", CODE[module])
        assert options, module
        missing = [o for o in options if not re.search(rf"{o}\b", text)]
        assert not missing, f"{module}'s options README never mentions: {missing}"


def test_every_module_name_readme_cites_exists():
    import importlib
    cited = set(re.findall(r"`(kit_[a-z]+)\.([A-Za-z_]\w*)", README.read_text()))
    loggers = set(re.findall(r"getLogger\(\"([\w.]+)\"\)", "".join(CODE.values())))
    cited = {(m, n) for m, n in cited if n not in ("py", "html") and f"{m}.{n}" not in loggers}
    assert cited
    missing = sorted(f"{m}.{n}" for m, n in cited if not hasattr(importlib.import_module(m), n))
    assert not missing, f"README cites names its modules lack: {missing}"
