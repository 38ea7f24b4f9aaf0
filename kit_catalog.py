"""kit_catalog: what a deck is made of: agents, workflows, skills and MCP tool servers.

Owns: ``Agent`` and ``Workflow`` (with their headless runners ``Agent.run``, ``Workflow.run``,
``resume`` and ``as_tool``, which SPEC puts on them), ``Skills``/``Skill`` (SKILL.md files, read
and checked once), ``MCP`` (a ``.mcp.json`` read and checked once), and the node helpers
``interrupt`` and ``sleep_until``.

Must never: do I/O or import an engine SDK at import (``import kit`` stays fast: the agents SDK
loads when a deck builds or a headless run starts); start anything (MCP servers start when a deck
opens); touch a log, a store or the Runtime.

Theory of operation: catalog objects are checked descriptions. Constructing one validates what can
be validated without starting anything (names, files, configs) and raises ``ConfigError`` naming
what is wrong. The engines (kit_agents, kit_workflows) compile them; they read them by their
public attributes only. The catalog sits *above* the engines, not below: the headless runners
SPEC puts on ``Agent`` and ``Workflow`` call the engines, so imports point from here down to
them, never back (the engines know these classes only under ``TYPE_CHECKING``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kit_core import HTTP_TOKEN, ConfigError, ContentBlock, check_limit, check_name

_log = logging.getLogger("kit.project")  # what a catalog leaves out: kit-serve prints it

__all__ = ("Agent", "Workflow", "Skills", "Skill", "MAX_SKILL_BYTES", "MCP", "MCP_TIMEOUT",
           "interrupt", "sleep_until")


def _is_sdk_tool(tool: Any) -> bool:
    import agents  # loaded only for a tool that is not a plain function
    return isinstance(tool, tuple(typing.get_origin(t) or t for t in typing.get_args(agents.Tool)))


def _is_sdk_model(model: Any) -> bool:
    import agents  # an agents.Model instance means the SDK is loaded already
    return isinstance(model, agents.Model)


class Agent:
    """A conversational agent, played by the openai-agents engine.

    ``instructions`` is text or a callable ``(ctx: Context, agent) -> str`` (sync or async).
    ``tools`` are plain functions (kit builds their schema; a ``Context[...]`` parameter is hidden
    from the model and injected) or SDK tool objects (passed through as built). ``hooks`` is an
    object with any of the SDK's agent hook methods (``on_start``, ``on_end``, ``on_llm_start``,
    ``on_llm_end``, ``on_tool_start``, ``on_tool_end``, ``on_handoff``); each receives a
    ``Context`` in place of the SDK's context argument. ``model`` is a model name (resolved by the
    SDK; ``KIT_MODEL`` is the default) or an ``agents.Model`` instance such as ``ScriptedModel``.
    ``skills``, ``mcp_servers`` and ``workflows`` are names resolved against the deck at ``build()``.
    ``history_limit`` caps the session history sent to the model on each turn with a session:
    only the last ``history_limit`` items of the conversation (each message, tool call and tool
    result is one item) go with the new input; the session still stores every item. None (the
    default) takes the deck's ``history_limit``, and when that is None too the whole history is
    sent. It is the SDK's own ``SessionSettings(limit=...)``, applied per run. ``max_turns``
    caps the model calls of one run (the SDK's ``max_turns``; None: its default, 10); a run that
    needs more fails with the SDK's ``MaxTurnsExceeded``.

    Raises ``ConfigError`` for a malformed name, a non-callable tool, a bad model, a string
    where a list of names goes, a name listed twice in one, ``hooks`` that is a class or has
    none of the hook methods, or a ``history_limit`` or ``max_turns`` that is not a positive
    int.
    """

    def __init__(self, name: str, instructions: str | Callable[..., Any] | None = None,
                 tools: Sequence[Any] = (), hooks: Any = None, *, model: str | Any = None,
                 model_settings: Any = None, output_type: type | None = None,
                 skills: Sequence[str] = (), mcp_servers: Sequence[str] = (),
                 workflows: Sequence[str] = (), history_limit: int | None = None,
                 max_turns: int | None = None) -> None:
        self.name = check_name("agent", name)
        self.history_limit = check_limit(f"agent {name!r}: history_limit", history_limit)
        self.max_turns = check_limit(f"agent {name!r}: max_turns", max_turns)
        if instructions is not None and not isinstance(instructions, str) and not callable(instructions):
            raise ConfigError(f"agent {name!r}: instructions must be a str or a callable, "
                              f"got {type(instructions).__name__}")
        for what, names in (("tools", tools), ("skills", skills), ("mcp_servers", mcp_servers),
                            ("workflows", workflows)):
            if isinstance(names, (str, bytes)):  # each character would be taken for a name
                raise ConfigError(f"agent {name!r}: {what} takes a list, got the string {names!r}")
            if not isinstance(names, Iterable):
                raise ConfigError(f"agent {name!r}: {what} takes a list, "
                                  f"got {type(names).__name__}")
        for t in tools:
            if not callable(t) and not _is_sdk_tool(t):
                raise ConfigError(f"agent {name!r}: tool {t!r} is neither a function nor an SDK tool")
        if hooks is not None:
            from kit_context import HOOK_METHODS  # the check's own list (`import kit` skips it)
            if isinstance(hooks, type) or not any(callable(getattr(hooks, m, None))
                                                  for m in HOOK_METHODS):
                # a class would have its methods called unbound; an object with none does nothing
                what = f"the class {hooks.__name__}" if isinstance(hooks, type) else type(hooks).__name__
                raise ConfigError(f"agent {name!r}: hooks must be an object with any of "
                                  f"{', '.join(HOOK_METHODS)}, got {what}")
        if model is not None and not isinstance(model, str) and not _is_sdk_model(model):
            raise ConfigError(f"agent {name!r}: model must be a model name or an agents.Model, "
                              f"got {type(model).__name__}")
        self.instructions, self.tools, self.hooks = instructions, tuple(tools), hooks
        self.model, self.model_settings, self.output_type = model, model_settings, output_type
        self.skills, self.mcp_servers = tuple(skills), tuple(mcp_servers)
        self.workflows = tuple(workflows)
        for what, names in (("skills", self.skills), ("mcp_servers", self.mcp_servers),
                            ("workflows", self.workflows)):
            # A server given twice has the SDK rename each of its tools (mcp_<server>__<tool>
            # is gone), a skill twice is listed twice: a mistake, said here.
            twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
            if twice is not None:
                raise ConfigError(f"agent {name!r}: {what} names {twice!r} twice")
        self._headless: Any = None

    def __repr__(self) -> str:
        return f"Agent({self.name!r})"

    async def run(self, input: str | Sequence[ContentBlock], *, session: Any = None,
                  max_turns: int | None = None) -> Any:
        """Play one turn headless: no deck, no log, no observers; returns the SDK's ``RunResult``.

        With a ``session`` (an ``agents.memory.Session``) the agent's own ``history_limit``
        applies. Tools that declare a ``Context[...]`` refuse when called (the run carries no
        context). Works under asyncio and trio (trio plays it on an asyncio thread that a trio
        run's headless calls share).
        """
        import kit_agents
        if self._headless is None:
            self._headless = kit_agents.compile_headless(self)
        return await kit_agents.run_headless(self._headless, input, session=session,
                                             max_turns=max_turns)


class Workflow:
    """A graph workflow, played by LangGraph: ``graph`` is an uncompiled ``StateGraph``.

    kit compiles it with the workflow's own checkpointer: a durable workflow (``durable=True``,
    or the class attribute ``durable`` of a subclass) keeps its checkpoints in the store's SQLite
    file, so a thread survives the process; otherwise they are in memory, and only while a run
    lasts (a run that ends deletes them; a parked one keeps them until it ends). A durable
    workflow's runs need a ``session_id``, which is the LangGraph thread id. Nodes may call
    ``kit.interrupt(payload)`` to wait for a human and ``kit.sleep_until(when)`` to sleep.

    ``run``, ``resume`` and ``as_tool`` are headless: no deck, no log, no observers; they use a
    private in-memory checkpointer kept by this object. A run given no ``thread_id`` plays on a
    thread of its own, which is deleted when it ends (kept while it waits for ``resume``); a
    ``thread_id`` of yours keeps its state between runs, as LangGraph's own. Raises
    ``ConfigError`` for a bad name, a graph that is not an uncompiled ``StateGraph`` or a
    ``durable`` that is not a bool.
    """
    durable: bool = False

    def __init__(self, name: str, graph: Any, *, durable: bool | None = None) -> None:
        from langgraph.graph import StateGraph
        self.name = check_name("workflow", name)
        if not isinstance(graph, StateGraph):
            raise ConfigError(f"workflow {name!r}: graph must be an uncompiled langgraph StateGraph, "
                              f"got {type(graph).__name__}")
        self.graph = graph
        if durable is not None:
            if not isinstance(durable, bool):  # bool("false") is True: a setting's text is no flag
                raise ConfigError(f"workflow {name!r}: durable must be True, False or None, "
                                  f"got {durable!r}")
            self.durable = durable
        self._headless: Any = None
        self._own_threads: set[str] = set()  # headless threads this object made, parked

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, durable={self.durable})"

    async def run(self, input: Mapping[str, Any], *, thread_id: str | None = None) -> Any:
        """Play the graph headless; the final state, or an ``InterruptResult`` if it parked."""
        import kit_workflows
        return await kit_workflows.run_headless(self._graph(), self.name, input, thread_id,
                                                own=self._own_threads)

    async def resume(self, thread_id: str, value: Any) -> Any:
        """Answer the thread's pending interrupt headless; final state or the next interrupt.
        Raises ``RunNotWaitingError`` when no question waits on the thread (never played, ended,
        or answered already)."""
        import kit_workflows
        return await kit_workflows.run_headless(self._graph(), self.name, None, thread_id,
                                                resume=value, own=self._own_threads)

    def as_tool(self, *, description: str | None = None) -> Any:
        """An SDK ``FunctionTool`` that plays this workflow headless on the model's input."""
        import kit_workflows
        graph = self._graph()
        return kit_workflows.workflow_tool(
            self.name, self.graph, description,
            lambda _context, args: kit_workflows.run_headless(graph, self.name, args, None,
                                                              own=self._own_threads))

    def _graph(self) -> Any:
        """The graph of the headless runs, compiled once with a private in-memory checkpointer."""
        if self._headless is None:
            import kit_threads
            self._headless = self.graph.compile(checkpointer=kit_threads.memory_saver())
        return self._headless


#: SKILL.md limits of the Agent Skills spec (agentskills.io; notes/CONVENTIONS.md B2).
_SKILL_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*\Z")
_SKILL_NAME_MAX, _SKILL_DESCRIPTION_MAX, _SKILL_COMPATIBILITY_MAX = 64, 1024, 500
#: A SKILL.md is read whole and served to a model in one tool result; the spec recommends a body
#: under 5,000 tokens, so a file this large is a mistake, not a skill.
MAX_SKILL_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Skill:
    """One skill of a ``Skills`` catalog: its ``SKILL.md`` front matter and Markdown body.

    Prose for a model to read, served by an agent's ``load_skill`` tool; never executed.
    """
    name: str
    description: str
    path: Path  # the SKILL.md file
    body: str = field(repr=False)


class Skills(Mapping):
    """A skill catalog (name -> ``Skill``) read from ``SKILL.md`` files.

    ``paths`` is one path or a sequence of them; each is a skill directory (holding
    ``SKILL.md``) or a directory of skill directories (``<path>/*/SKILL.md``). Each ``SKILL.md``
    opens with YAML front matter between ``---`` lines: ``name`` (1-64 characters of lowercase
    letters, digits and single hyphens, not at either end, equal to the directory's name) and
    ``description`` (1-1024 characters: what the skill does and when to use it); the Markdown
    after it is the body ``load_skill`` serves. Every front-matter value is read as text, as
    written (``version: 1.0`` is ``"1.0"``), as the spec's reference parser reads it. Files are
    read here, once. A directory of skill directories whose subdirectory holds no ``SKILL.md``
    is a warning naming it, on the ``kit.project`` logger.

    Raises ``ConfigError`` naming the file for a missing or malformed front matter (a key
    written twice in one mapping, too), a bad name or description, a file over
    ``MAX_SKILL_BYTES``, a ``SKILL.md`` that is not a readable regular file, or two skills of
    the same name; and for a path that is not a directory.
    """

    def __init__(self, paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = ()) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not isinstance(paths, Iterable):
            raise ConfigError(f"skills takes a path or a list of paths, got {type(paths).__name__}")
        self._skills: dict[str, Skill] = {}
        for p in paths:
            if not isinstance(p, (str, os.PathLike)):
                raise ConfigError(f"a skills path must be a str or a path, got {type(p).__name__}")
            root = Path(p)
            if (root / "SKILL.md").exists() or (root / "SKILL.md").is_symlink():
                files = [root / "SKILL.md"]  # one that is not a regular file is refused there
            elif root.is_dir():
                files = bundle_files(root, "SKILL.md")
                # A directory with no SKILL.md (a group of skills, a skill.md) is no skill: said,
                # or the agent naming a skill in it learns only that there is no such skill.
                for lost in sorted({d for d in root.iterdir() if d.is_dir() and d.name[0] not in
                                    "._"} - {f.parent for f in files}):
                    _log.warning("%s is not loaded: a skill is %s/<skill>/SKILL.md", lost, root)
            else:
                raise ConfigError(f"no skills at {str(root)!r}: expected a skill directory (with "
                                  "SKILL.md) or a directory of them")
            for file in files:
                skill = _read_skill(file)
                if skill.name in self._skills:
                    raise ConfigError(f"two skills are named {skill.name!r}: "
                                      f"{self._skills[skill.name].path} and {file}")
                self._skills[skill.name] = skill

    def __getitem__(self, name: str) -> Skill:
        return self._skills[name]

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self._skills)

    def __len__(self) -> int:
        return len(self._skills)

    def __repr__(self) -> str:
        return f"Skills({list(self._skills)})"


def bundle_files(root: Path, filename: str) -> list[Path]:
    """``root/*/filename`` in name order: the bundle (or skill) files of a project directory.

    A directory that holds no ``filename`` is not a bundle. Raises ``ConfigError`` naming what
    cannot be read: ``root`` or a bundle directory that cannot be listed, or a ``filename`` that
    is not a regular file (a FIFO would hang its reader, a looping or dangling symlink would be
    skipped without a word)."""
    try:
        dirs = sorted(d for d in root.iterdir() if d.is_dir())
        files = []
        for d in dirs:
            file = d / filename
            if file.is_file():
                files.append(file)
            elif file.is_symlink() or file.exists():
                raise ConfigError(f"{file} is not a regular file" if file.exists() else
                                  f"{file} is a symlink that leads to no file")
    except OSError as exc:
        raise ConfigError(f"{exc.filename or root} cannot be read: {exc.strerror or exc}") from None
    return files


def _read_skill(file: Path) -> Skill:
    """Parse and validate one ``SKILL.md`` (YAML front matter, then the body).

    The front matter is read with PyYAML's ``BaseLoader``: no tags are constructed and every
    scalar is a string, as written (``name: 2024-01-01``, ``description: Yes`` and a metadata
    ``version: 1.0`` are text, not a date, a bool and a float)."""
    import yaml
    try:
        if not file.is_file():
            raise ConfigError(f"{file} is not a regular file")
        if file.stat().st_size > MAX_SKILL_BYTES:
            raise ConfigError(f"{file} is larger than {MAX_SKILL_BYTES} bytes; keep SKILL.md short "
                              "and put long material in files it references")
        text = file.read_text(encoding="utf-8").removeprefix("\ufeff")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} cannot be read: {exc}") from None
    lines = text.splitlines(keepends=True)
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None) \
        if lines and lines[0].strip() == "---" else None
    if end is None:
        raise ConfigError(f"{file} must open with YAML front matter between '---' lines "
                          "(name and description)")
    try:  # every value as text, as the spec's reference parser (strictyaml) reads it
        meta = yaml.load("".join(lines[1:end]), Loader=_unique_keys_loader(yaml))
    except yaml.MarkedYAMLError as exc:  # its mark counts from the front matter's first line
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 2} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{file}{where}: the front matter is not valid YAML: "
                          f"{exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: the front matter is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{file}: the front matter is nested too deeply") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{file}: the front matter must be a mapping with name and description")
    name, description = meta.get("name"), meta.get("description")
    if not isinstance(name, str) or not 1 <= len(name) <= _SKILL_NAME_MAX \
            or not _SKILL_NAME.match(name):
        raise ConfigError(f"{file}: name must be 1-{_SKILL_NAME_MAX} characters of lowercase "
                          "letters, digits and single hyphens, not starting or ending with one; "
                          f"got {name!r}")
    dirname = Path(os.path.abspath(file)).parent.name  # Skills(".") inside the skill: not ''
    if name != dirname:
        raise ConfigError(f"{file}: name {name!r} must equal its directory's name {dirname!r}")
    if not isinstance(description, str) or not description.strip() \
            or len(description) > _SKILL_DESCRIPTION_MAX:
        raise ConfigError(f"{file}: description is required: 1-{_SKILL_DESCRIPTION_MAX} characters "
                          "saying what the skill does and when to use it")
    compatibility = meta.get("compatibility")
    if compatibility is not None and (not isinstance(compatibility, str)
                                      or len(compatibility) > _SKILL_COMPATIBILITY_MAX):
        raise ConfigError(f"{file}: compatibility must be text of at most "
                          f"{_SKILL_COMPATIBILITY_MAX} characters")
    metadata = meta.get("metadata") or None  # an empty ``metadata:`` is text too: none
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ConfigError(f"{file}: metadata must map strings to strings")
    return Skill(name, description.strip(), file, "".join(lines[end + 1:]).strip())


def _unique_keys_loader(yaml: Any) -> Any:
    """PyYAML's ``BaseLoader`` refusing a key written twice in one mapping, as strictyaml does:
    PyYAML keeps the last, so a second ``description:`` would replace the first in silence."""
    class Loader(yaml.BaseLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[str] = set()
            for key in (k for k, _ in node.value if isinstance(k, yaml.ScalarNode)):
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key.value!r} is written twice", key.start_mark)
                seen.add(key.value)
            return super().construct_mapping(node, deep)
    return Loader


#: The per-request read timeout of an MCP server (seconds) unless its config says ``timeout``.
#: The SDK's own default, 5 s, fails ordinary slow tools (notes/ENGINES.md 7).
MCP_TIMEOUT = 30.0
_MCP_KINDS = {"stdio": "stdio", "http": "http", "streamable-http": "http",
              "streamableHttp": "http", "sse": "sse"}
_VAR = re.compile(r"\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_NOT_IN_HEADER = re.compile("[\r\n\x00]")
#: What no URL holds (RFC 3986): a control character (Python's urlsplit drops a line break in
#: silence, the HTTP client refuses it; neither says so in the config's terms).
_NOT_IN_URL = re.compile("[\x00-\x1f\x7f]")


class MCP:
    """External tool servers (MCP): a ``.mcp.json`` file's path, or its content as a mapping.

    The formats of Claude Code and Cursor (top-level ``mcpServers``) and VS Code (``servers``)
    are read, or a mapping of server name -> config. A server with ``command`` (``args``,
    ``env``, ``cwd``) is stdio; with ``url`` (``headers``) streamable HTTP; SSE only when
    ``"type": "sse"``. ``${VAR}``, ``${env:VAR}`` and ``${VAR:-default}`` are expanded from the
    environment in command, args, env, url and headers, here, once. ``timeout`` (seconds,
    default ``MCP_TIMEOUT``) bounds each request to the server. A stdio server with ``env``
    gets the process environment plus those keys; without, the SDK's minimal one (HOME, PATH,
    ...). A file's stdio server runs in the file's directory (a relative ``cwd`` is taken from
    there, as are a relative command and arguments then). An agent's tools from server
    ``time`` are named ``mcp_time__<tool>``.

    Nothing starts here or at ``build()``: opening the deck connects every server, closing it
    tears them down. Raises ``ConfigError`` for an unreadable file, a malformed config (a key
    twice in one object of the file, too), an unknown ``type``, a variable that is unset and has
    no default, ``${input:...}``, a command, ``args`` or ``env`` entry no process can take (a
    NUL once expanded, an empty command; an env name that is empty or holds ``=``), a header
    no request can carry (a name that is not an HTTP token; a value with a line break or NUL
    once expanded), or a ``url`` no request can reach (no host, a malformed host or port, a
    control character once expanded). Each names the entry, never its value (a url or a
    command is quoted as written).
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        home = None  # a file's directory: where its stdio servers run (``_mcp_server``)
        if isinstance(config, (str, os.PathLike)):
            self.source, home = str(config), Path(config).absolute().parent
            try:
                if Path(config).exists() and not Path(config).is_file():  # a FIFO: the read hangs
                    raise ConfigError(f"MCP config {self.source} is not a regular file")
                # utf-8-sig: a BOM (Notepad's) is read past, as VS Code does and SKILL.md is
                data = json.loads(Path(config).read_text(encoding="utf-8-sig"),
                                  object_pairs_hook=_unique_keys)
            except OSError as exc:
                raise ConfigError(f"cannot read MCP config {self.source}: {exc}") from None
            except ValueError as exc:
                raise ConfigError(f"MCP config {self.source} is not valid JSON: {exc}") from None
            except RecursionError:
                raise ConfigError(f"MCP config {self.source} is nested too deeply") from None
            except _DuplicateKey as exc:
                raise ConfigError(f"MCP config {self.source} has the key {exc} twice in one "
                                  "object; keep one") from None
        elif isinstance(config, Mapping):
            self.source, data = "MCP(...)", config
        else:
            raise ConfigError(f"MCP(...) takes a path to a .mcp.json or a mapping, "
                              f"got {type(config).__name__}")
        if not isinstance(data, Mapping):
            raise ConfigError(f"{self.source}: an MCP config is a JSON object")
        if "mcpServers" in data and "servers" in data:
            raise ConfigError(f"{self.source} has both 'mcpServers' and 'servers'; keep one")
        servers = data.get("mcpServers", data.get("servers", data))
        if not isinstance(servers, Mapping):
            raise ConfigError(f"{self.source}: the servers must be an object of name -> config")
        self.servers: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({
            check_name(f"{self.source}: MCP server", n): _mcp_server(self.source, n, s, home)
            for n, s in servers.items()})

    def __repr__(self) -> str:
        return f"MCP({list(self.servers)})"


class _DuplicateKey(Exception):
    """A key twice in one JSON object (its name, never a value: a value may be a secret)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of a repeated key: a server pasted twice would vanish without a word
    out = dict(pairs)
    if len(out) < len(pairs):
        raise _DuplicateKey(repr(next(k for i, (k, _) in enumerate(pairs)
                                      if k in (p[0] for p in pairs[:i]))))
    return out


def _expand(source: str, value: Any) -> Any:
    """``${VAR}``, ``${env:VAR}`` and ``${VAR:-default}`` (default when unset or empty)."""
    if isinstance(value, list):
        return [_expand(source, v) for v in value]
    if isinstance(value, dict):
        return {k: _expand(source, v) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        expr = m.group(1).removeprefix("env:")
        if expr.startswith("input:"):
            raise ConfigError(f"{source}: {m.group(0)} asks for user input, which a server cannot "
                              "prompt for; use an environment variable")
        name, has_default, default = expr.partition(":-")
        if not _VAR_NAME.match(name):
            raise ConfigError(f"{source}: {m.group(0)} is not a variable reference")
        found = os.environ.get(name)
        if has_default:
            return found or default
        if found is None:
            raise ConfigError(f"{source}: environment variable {name} is not set and "
                              f"{m.group(0)} has no default (write ${{{name}:-default}})")
        return found

    return _VAR.sub(sub, value)


def _mcp_server(source: str, name: str, raw: Any, home: Path | None) -> dict[str, Any]:
    where = f"{source}: MCP server {name!r}"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be an object")
    kind = raw.get("type") or ("stdio" if "command" in raw else "http" if "url" in raw else None)
    if kind is None:
        raise ConfigError(f"{where} needs a 'command' (stdio) or a 'url' (HTTP)")
    if not isinstance(kind, str) or kind not in _MCP_KINDS:
        raise ConfigError(f"{where} has unknown type {kind!r}; expected stdio, http or sse")
    timeout = raw.get("timeout", MCP_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 < timeout < sys.float_info.max):  # (an int past it: no float holds it)
        raise ConfigError(f"{where}: timeout must be a positive, finite number of seconds, "
                          f"got {timeout!r}")
    out: dict[str, Any] = {"type": _MCP_KINDS[kind], "timeout": float(timeout)}

    def strings(key: str, shape: type) -> Any:
        value = raw.get(key)
        if value is not None and not (isinstance(value, shape) and (
                shape is list or all(isinstance(k, str) for k in value))):
            raise ConfigError(f"{where}: {key} must be "
                              f"{'a list of strings' if shape is list else 'an object of strings'}")
        # Each entry named (never its value: it may be a secret), here rather than as the
        # server starts, where the OS said only "embedded null byte" or "illegal ... name".
        for k, v in (enumerate(value) if shape is list else value.items()) if value else ():
            if not isinstance(v, str):
                raise ConfigError(f"{where}: {key}[{k!r}] must be a string, got {type(v).__name__}")
            if key == "env" and (not k or "=" in k or "\0" in k):
                raise ConfigError(f"{where}: env {k!r} is not an environment variable name")
        value = None if value is None else _expand(where, value)
        for k, v in (enumerate(value) if shape is list else value.items()) if value else ():
            if key != "headers" and "\0" in v:
                raise ConfigError(f"{where}: {key}[{k!r}] holds a NUL once expanded")
        return value

    if out["type"] == "stdio":
        command = raw.get("command")
        if not isinstance(command, str) or not command:
            raise ConfigError(f"{where}: a stdio server needs a 'command' string")
        cwd = raw.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ConfigError(f"{where}: cwd must be a string")
        if home is not None:  # a file's server runs where the file is, as Claude Code's do:
            cwd = str(home / (cwd or "."))  # not wherever kit-serve was started
        program = _expand(where, command)  # named here, as args are: the open said only
        if not program.strip():  # "Permission denied: ''" or "embedded null byte"
            raise ConfigError(f"{where}: the command {command!r} is empty once expanded")
        if "\0" in program:  # (the command is not quoted: it may hold a secret)
            raise ConfigError(f"{where}: the command holds a NUL once expanded")
        out.update(command=program, args=strings("args", list) or [],
                   env=strings("env", dict), cwd=cwd)
    else:
        written = raw.get("url")  # quoted as written: its ${VAR}s may hold a secret
        url = _expand(where, written) if isinstance(written, str) else written
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: an {out['type']} server needs an http(s) 'url', "
                              f"got {written!r}")
        fault = _url_fault(url)
        if fault is not None:  # else the open fails as "closed the connection while connecting"
            raise ConfigError(f"{where}: the url {written!r} {fault}")
        headers = strings("headers", dict) or {}
        for key, value in headers.items():  # else the open fails as "closed the connection"
            if not HTTP_TOKEN.fullmatch(key):
                raise ConfigError(f"{where}: {key!r} is not an HTTP header name")
            if _NOT_IN_HEADER.search(value):  # the value is not quoted: it may be a secret
                raise ConfigError(f"{where}: header {key!r} holds a line break or NUL once "
                                  "expanded (a secret read with its trailing newline?)")
        out.update(url=url, headers=headers)
    return out


def _url_fault(url: str) -> str | None:
    """Why the http(s) ``url`` (expanded) names no server a request can reach, in words that
    never quote it (its ``${VAR}``s may hold a secret), or None."""
    if _NOT_IN_URL.search(url):
        return "holds a line break or control character once expanded"
    try:
        parts = urlsplit(url)
        parts.port  # raises for a port that is not a number up to 65535
    except ValueError:
        return "has a malformed host or port"
    if " " in parts.netloc:  # (one in the path is the client's to escape, and it does)
        return "has a malformed host or port"
    if not parts.hostname:
        return "has no host"
    return None


def interrupt(payload: Any) -> Any:
    """Inside a workflow node: park the run until a human answers; returns the answer.

    The node runs again from its first line when answered, so keep side effects after this call
    (or idempotent). Outside a workflow node LangGraph raises its own error.
    """
    from langgraph.types import interrupt as lg_interrupt
    return lg_interrupt(payload)


def sleep_until(when: datetime) -> Any:
    """Inside a durable workflow node: park the thread until ``when`` (timezone-aware).

    ``deck.tick()`` wakes it once that time has passed; returns ``{"woke_at": <iso time>}``. The
    node re-runs on wake, so compute ``when`` once (in state, or in an earlier node), never as
    ``now() + delta`` inside this node. Raises ``ConfigError`` for a naive datetime.
    """
    if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
        raise ConfigError(f"sleep_until needs a timezone-aware datetime, got {when!r}")
    return interrupt({"kind": "sleep", "until": when.astimezone(timezone.utc).isoformat()})


