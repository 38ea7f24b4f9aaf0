"""The README's code runs as written: every fenced block marked ```` ```python runnable ```` is
executed, offline (ScriptedModel), in an empty directory, with no kit setting in the environment."""
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
