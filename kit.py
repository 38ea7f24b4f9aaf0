"""kit: the composition root: ``Deck``, and the public names of kit in one place.

Owns: ``Deck`` (its catalog, ``build()``, its lifecycle and every call a user makes on it) and
``Deck.from_project``. Re-exports the public names of ``kit_core`` (values: errors, content,
events, results, ports) and ``kit_catalog`` (``Agent``, ``Workflow``, ``Skills``, ``MCP``, ...),
so ``import kit; kit.Agent, kit.TextBlock`` work; ``kit.ScriptedModel`` loads the agents SDK on
first use.

Must never: do I/O at import, start tasks, open sockets or files, read the environment at import,
or import an engine SDK at import (``import kit`` stays under 0.5 s): ``Deck.build()`` imports the
engines a deck uses (kit_agents, with the agents SDK, only for agents or MCP servers;
kit_mcp_servers only for MCP servers; kit_workflows) and opening a deck imports kit_runtime.

Theory of operation: a ``Deck`` holds a catalog. ``build()`` checks every name and compiles each
agent and workflow into an ``InvocableSpec``; ``async with deck`` opens a ``kit_runtime.Runtime``
over one event store. Every turn becomes a *run* whose events (``Event`` envelopes with typed
payloads) are appended to the store's log in order; ``TurnResult`` is read back from the run's own
``run.completed`` event. The path of an event: a call on the Deck -> the Runtime -> the engine,
which records through its run handle -> the Runtime's writer -> the store; once committed, the
observers; live readers of the run as it is sequenced.
"""
from __future__ import annotations

import contextvars
import importlib.util
import logging
import os
import sys
import threading
import types
import typing
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import kit_catalog
import kit_core
from kit_catalog import *  # noqa: F403  (re-exported: kit_catalog.__all__)
from kit_catalog import MCP, Agent, Skill, Skills, Workflow
from kit_core import *  # noqa: F403  (re-exported: kit_core.__all__)
from kit_core import (
    ConfigError, DeckStateError, Due, Event, EventSinkPort, EventStorePort, HistoryMessage,
    InvocableSpec, InterruptResult, Pending, RunStatus, Ticked, TurnResult, UnknownNameError,
)
from kit_core import aware as _aware  # a helper, not part of kit's surface

#: What ``import kit`` offers: the values (kit_core), the catalog (kit_catalog), ``Deck``, and
#: ``ScriptedModel`` (kit_scripted, loaded on first use: it imports the agents SDK).
__all__ = (*kit_core.__all__, *kit_catalog.__all__, "Deck", "ScriptedModel")
__version__ = kit_core.VERSION


def __getattr__(name: str) -> Any:
    # ScriptedModel subclasses agents.Model: importing it imports the agents SDK (~1.5 s), which
    # a user who never builds an agent on it should not pay at `import kit`.
    if name == "ScriptedModel":
        from kit_scripted import ScriptedModel
        globals()["ScriptedModel"] = ScriptedModel
        return ScriptedModel
    if name == "core":  # after `import kit.core` (an alias, _alias_core), as for a package
        return kit_core
    raise AttributeError(f"module 'kit' has no attribute {name!r}")


# ======================================================================================= Deck ====

_log = logging.getLogger("kit.project")  # what from_project leaves out: kit-serve prints it
_live_deck: weakref.ref[Deck] | None = None  # SPEC 4.1 rule 6: one live deck per process
#: How a deck names itself in that rule's error: its project while ``from_project`` makes it.
_making: contextvars.ContextVar[str | None] = contextvars.ContextVar("kit_making", default=None)


class Deck:
    """The composition root: a catalog of agents and workflows played on one Runtime over one
    event log.

    Lifecycle (SPEC 3.1): NEW -> ``build()`` -> BUILT -> ``async with deck`` -> OPEN ->
    ``aclose()`` -> CLOSED, which is terminal; while ``async with deck`` opens it, the deck is
    OPENING, and another task's open is refused. Only one deck may be live (not CLOSED) per
    process.

    ``skills`` is a path, a sequence of paths or a ``Skills`` catalog; ``mcp`` a path to a
    ``.mcp.json``, a mapping or an ``MCP``: the skills and tool servers agents name in
    ``skills=`` and ``mcp_servers=``. The deck holds the MCP servers: opening it connects every
    one, closing it tears them down.
    ``context`` declares the type of the per-run context (a type, never an instance).
    ``session_factory(session_id) -> Session`` replaces the conversation-memory sessions;
    ``store`` is an open ``EventStorePort`` (the deck never closes a store passed in); without one
    the deck builds it from ``KIT_STORE`` (default: in memory) and closes it at ``aclose()``.
    ``observers``: None (settings decide: the tracing observer when both ``KIT_TRACING_*`` keys
    are set), a sequence (exactly those, in order) or ``()`` (none); see ``kit_observers``.
    ``history_limit`` is the limit on the session history sent to the model for the agents that
    set none (``Agent(history_limit=)``); None (the default): ``KIT_HISTORY_LIMIT`` when set,
    else the whole history.

    Raises ``ConfigError`` when another deck is live, ``context`` is an instance or
    ``history_limit`` is not a positive int, and as ``Skills`` and ``MCP`` do for files or
    configs they refuse.
    """

    def __init__(self, agents: Sequence[Agent] = (), workflows: Sequence[Workflow] = (), *,
                 skills: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Skills | None = (),
                 mcp: str | os.PathLike[str] | Mapping[str, Any] | MCP | None = None,
                 context: type | None = None, session_factory: Callable[[str], Any] | None = None,
                 store: EventStorePort | None = None,
                 observers: Sequence[EventSinkPort] | None = None,
                 history_limit: int | None = None) -> None:
        global _live_deck
        self._project = _making.get() or self._where()
        other = _live_deck() if _live_deck is not None else None
        if other is not None and other._state != "CLOSED":
            raise ConfigError(f"another Deck is live in this process ({other._project}); close it "
                              f"with `await deck.aclose()` before creating {self._project} "
                              "(one live deck per process)")
        if context is not None and not isinstance(context, type) and typing.get_origin(context) is None:
            raise ConfigError(f"Deck(context=...) takes the context's type, not an instance "
                              f"(got a {type(context).__name__}); pass the object per run: "
                              "deck.run(..., context=obj)")
        self._history_limit = kit_core.check_limit("Deck(history_limit=...)", history_limit)
        self._agents = _catalog("agents", agents, Agent)
        self._workflows = _catalog("workflows", workflows, Workflow)
        self._skills = skills if isinstance(skills, Skills) else Skills(skills or ())
        self._mcp = mcp if isinstance(mcp, MCP) or mcp is None else MCP(mcp)
        self._observers = observers
        self._default_store = "memory"  # from_project: a SQLite file inside the project
        self.context_type = context
        if session_factory is not None and not callable(session_factory):
            raise ConfigError(f"Deck(session_factory=...) takes a callable (key -> an SDK "
                              f"session), got {type(session_factory).__name__}")
        if store is not None and not (callable(getattr(store, "append", None))
                                      and callable(getattr(store, "read", None))):
            hint = (": set KIT_STORE to a URL, or pass kit_runtime.store_from_url(url)"
                    if isinstance(store, (str, os.PathLike)) else "")
            raise ConfigError(f"Deck(store=...) takes an event store (SQLiteStore(path), "
                              f"PostgresStore(url), ...), got {type(store).__name__}{hint}")
        self._session_factory, self._store = session_factory, store
        self._specs: dict[str, InvocableSpec] = {}
        self._mcp_servers: dict[str, Any] = {}
        self._state = "NEW"
        self._runtime: Any = None
        self._opener: int | None = None
        self._thread: int | None = None  # the thread of the event loop that opened it
        _live_deck = weakref.ref(self)

    @classmethod
    def from_project(cls, path: str | os.PathLike[str] = ".kit", **kwargs: Any) -> Deck:
        """A deck of the project at ``path``: ``agents/<bundle>/agent.py`` (each defines a
        module-level ``agent``), ``workflows/<bundle>/workflow.py`` (``workflow``),
        ``skills/<name>/SKILL.md``, and the MCP servers of ``.mcp.json`` beside the project
        directory (in its parent), when there is one.

        Bundles load from their files, in name order, with no ``sys.path`` change (each is in
        ``sys.modules`` as ``kit_project_<kind>_<bundle>``, a dot in ``<bundle>`` as ``_``, as
        its dataclasses and type hints need; a package of its directory, so its other files
        import as ``from . import x``).
        Without ``KIT_STORE`` the log is the SQLite file ``<path>/.state/kit.db``. Other keyword
        arguments go to the constructor (``skills=`` or ``mcp=`` replace what was found).
        Python that no bundle loads (``agents/chat.py``, a bundle directory without its
        ``agent.py``) is a warning naming it, on the ``kit.project`` logger. Raises
        ``ConfigError`` for a ``path`` that is no str or Path, a missing directory, naming the
        file of a bundle that fails to import, lacks its object, is not a regular file or shares
        its name with another, and as ``Skills`` and ``MCP`` do.
        """
        if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
            raise ConfigError(f"Deck.from_project(path=...) takes a directory's path (a str or a "
                              f"Path), got {type(path).__name__}")
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"no kit project at {str(root)!r} (a directory with agents/ and "
                              "workflows/ bundles); set KIT_PROJECT or pass path=")
        from kit_catalog import bundle_files  # kit's namespace is its __all__
        bundles: dict[str, tuple[Path, Any]] = {}
        for kind, attr, type_ in (("agents", "agent", Agent), ("workflows", "workflow", Workflow)):
            files = bundle_files(root / kind, f"{attr}.py") if (root / kind).is_dir() else []
            # Python no bundle loads (agents/chat.py; agents/chat/agents.py) would leave the deck
            # without it in silence: said, naming it (kit-serve prints it).
            stray = [f for f in sorted((root / kind).glob("*.py")) if f.name != "__init__.py"]
            for lost in stray + sorted({f.parent for f in (root / kind).glob("*/*.py")}
                                       - {f.parent for f in files}):
                _log.warning("%s is not loaded: a bundle is %s/<bundle>/%s.py defining %r",
                             lost, kind, attr, attr)
            for file in files:
                found = _load_bundle(file, attr, type_)
                if found.name in bundles:
                    raise ConfigError(f"{bundles[found.name][0]} and {file} both define "
                                      f"{found.name!r}; names must be unique across agents and "
                                      "workflows")
                bundles[found.name] = (file, found)
        agents = [b for _, b in bundles.values() if isinstance(b, Agent)]
        workflows = [b for _, b in bundles.values() if isinstance(b, Workflow)]
        if "skills" not in kwargs and (root / "skills").is_dir():
            kwargs["skills"] = Skills(root / "skills")
        mcp_json = root.resolve().parent / ".mcp.json"
        if "mcp" not in kwargs and (mcp_json.exists() or mcp_json.is_symlink()):
            kwargs["mcp"] = MCP(mcp_json)  # one that is not a regular file is refused there
        token = _making.set(f"project {str(root.resolve())!r}")
        try:
            deck = cls(agents, workflows, **kwargs)
        finally:
            _making.reset(token)
        from kit_store import project_log_url  # not at import: `import kit` stays light
        deck._default_store = project_log_url(root)
        return deck

    def asgi(self) -> Any:
        """The ASGI application serving this deck over HTTP (kit_http): its lifespan opens the
        deck and closes it. Needs the ``serve`` extra only to run under Hypercorn."""
        import kit_http
        return kit_http.App(self)

    @staticmethod
    def _where() -> str:
        frame = sys._getframe(2)
        return f"Deck created at {frame.f_code.co_filename}:{frame.f_lineno}"

    def __repr__(self) -> str:
        return (f"<Deck {self._state} agents={[a.name for a in self._agents]} "
                f"workflows={[w.name for w in self._workflows]}>")

    @property
    def agents(self) -> Mapping[str, Agent]:
        """The agents by name (read-only)."""
        return types.MappingProxyType({a.name: a for a in self._agents})

    @property
    def workflows(self) -> Mapping[str, Any]:
        """The workflows by name (read-only)."""
        return types.MappingProxyType({w.name: w for w in self._workflows})

    @property
    def skills(self) -> Mapping[str, Skill]:
        """The skills by name (read-only)."""
        return types.MappingProxyType(dict(self._skills))

    @property
    def mcp(self) -> MCP | None:
        """The deck's MCP servers (``MCP.servers`` maps name -> config), or None."""
        return self._mcp

    # -------------------------------------------------------------------------- lifecycle --
    def build(self) -> Deck:
        """Check every name and compile the catalog; reads local files only, starts nothing.

        Idempotent. Raises ``ConfigError`` for a duplicate name, an agent and a workflow sharing
        a root name, or an unknown skill, MCP server or workflow-as-tool name;
        ``ConfigError`` for a ``KIT_HISTORY_LIMIT`` that is not a positive integer (read by a deck
        with agents when ``history_limit=`` is None);
        ``ContextTypeError`` when a tool, instructions callable, hook or node requires a context
        the declared ``context=`` type cannot satisfy (SPEC 4.2; no check without ``context=``);
        ``DeckStateError`` on a closed deck.
        """
        if self._state == "CLOSED":
            raise DeckStateError("CLOSED", "build")
        if self._state != "NEW":
            return self
        import kit_context
        import kit_observers
        import kit_workflows
        kit_observers.check_observers(self._observers)
        names: dict[str, str] = {}
        for kind, name in [("agent", a.name) for a in self._agents] + [
                ("workflow", w.name) for w in self._workflows]:
            if name in names:
                raise ConfigError(f"two invocables are named {name!r} ({names[name]} and {kind}); "
                                  "names must be unique across agents and workflows")
            names[name] = kind
        workflows = {w.name: w for w in self._workflows}
        servers = self._mcp.servers if self._mcp is not None else {}
        catalogs: dict[str, Mapping[str, Any]] = {"skill": self._skills, "MCP server": servers,
                                                  "workflow": workflows}
        for a in self._agents:
            for what, wanted in (("skill", a.skills), ("MCP server", a.mcp_servers),
                                 ("workflow", a.workflows)):
                for n in wanted:
                    if n not in catalogs[what]:
                        known = ", ".join(catalogs[what]) or "none"
                        raise ConfigError(f"agent {a.name!r} names unknown {what} {n!r} "
                                          f"(the deck has: {known})")
        specs = {w.name: kit_workflows.compile_workflow(w) for w in self._workflows}
        self._mcp_servers = {}
        if self._agents or servers:  # the agents SDK (~1.4 s, ~45 MB) only for a deck that uses it
            import kit_agents
            limit = self._history_limit  # else the setting: kit-serve's way to pass it
            if limit is None:
                raw = os.environ.get("KIT_HISTORY_LIMIT")
                limit = kit_core.count_setting("KIT_HISTORY_LIMIT", raw)
            if servers:  # the SDK's MCP client classes only for a deck with MCP servers
                import kit_mcp_servers
                # The SDK's server objects, made here unconnected: opening the deck connects them.
                self._mcp_servers = kit_mcp_servers.mcp_servers(self._mcp)
            for a in self._agents:  # an agent's workflows become tools that play child runs
                specs[a.name] = kit_agents.compile_agent(
                    a, tools=[kit_workflows.child_tool(specs[n]) for n in a.workflows],
                    skills=[self._skills[n] for n in a.skills],
                    mcp_servers=[self._mcp_servers[n] for n in a.mcp_servers],
                    history_limit=limit)
        self._specs = specs
        if self.context_type is not None:
            kit_context.check_context(list(self._specs.values()), self.context_type)
        self._state = "BUILT"
        return self

    async def __aenter__(self) -> Deck:
        if self._state in ("OPENING", "OPEN", "CLOSED"):
            raise DeckStateError(self._state, "open the deck")
        import anyio
        try:
            self.build()
            self._state = "OPENING"  # a second task's open, meanwhile, would start a second Runtime
            import kit_runtime
            runtime = kit_runtime.Runtime(self._specs, store=self._store,
                                          session_factory=self._session_factory,
                                          observers=self._observers,
                                          default_store=self._default_store,
                                          mcp_servers=list(self._mcp_servers.values()))
            await runtime.open()
        except BaseException:  # a deck that failed to open is closed: it frees the live slot
            self._release()
            raise
        # The Runtime's task group belongs to this task: only this task can close it.
        self._opener, self._thread = anyio.get_current_task().id, threading.get_ident()
        self._runtime, self._state = runtime, "OPEN"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the deck for good: stop the Runtime, tear down its MCP servers (no child process
        is left), close the store it built. Idempotent.

        Raises ``DeckStateError`` (and closes nothing) when called from another task than the one
        that opened the deck (or is opening it): the deck's background tasks belong to that task.
        """
        if self._state == "OPENING":  # the opener is in __aenter__: this is another task
            raise DeckStateError("OPENING", "close the deck from another task than the one "
                                 "opening it")
        if self._state == "OPEN":
            import anyio
            if anyio.get_current_task().id != self._opener:
                raise DeckStateError("OPEN", "close the deck from another task than the one that "
                                     "opened it (close it where `async with deck:` is)")
            self._state = "CLOSED"
            await self._runtime.close()
        self._release()

    def _release(self) -> None:
        global _live_deck
        self._state = "CLOSED"
        if _live_deck is not None and _live_deck() is self:
            _live_deck = None

    # ------------------------------------------------------------------------------ turns --
    def _open(self, action: str) -> Any:
        """The Runtime, for an action that needs an open deck (``DeckStateError`` otherwise)."""
        if self._state != "OPEN":
            raise DeckStateError(self._state, action)
        if threading.get_ident() != self._thread:  # another loop: its tasks cannot touch ours
            tool = self._runtime.for_tool()  # (under trio, a tool of a run on the engines' loop)
            if tool is None:
                raise DeckStateError("OPEN", f"{action} from another thread than the event "
                                     "loop's that opened the deck (call it there: "
                                     "anyio.from_thread.run)")
            return tool
        return self._runtime

    def _spec(self, action: str, name: str) -> tuple[Any, InvocableSpec]:
        """The Runtime (as ``_open`` gives it) and the invocable ``name``."""
        runtime = self._open(action)
        spec = self._specs.get(name) if isinstance(name, str) else None  # (a list: unhashable)
        if spec is None:
            raise UnknownNameError(name, self._specs)
        return runtime, spec

    async def run(self, name: str, input: Any, *, context: Any = None, session_id: str | None = None,
                  namespace: str | None = None, run_id: str | None = None,
                  history: Sequence[HistoryMessage] | None = None
                  ) -> TurnResult | InterruptResult | dict[str, Any]:
        """Play one turn to its end and return what it produced.

        For an agent, a ``TurnResult`` built from ``run.completed``. For a workflow, ``input`` is
        a mapping (the initial state) and the result is the final state mapping, or an
        ``InterruptResult`` when the run parked (waiting for a human, or sleeping);
        ``session_id`` is the thread id (required for a durable workflow) and a later call on
        the same thread carries on from where it stopped.

        ``history`` gives a one-off agent turn (no ``session_id``) the conversation before
        ``input``: ``HistoryMessage``s the model reads first, recorded in ``run.started``.

        Raises ``DeckStateError`` unless open, ``UnknownNameError``, ``ContentError`` for bad
        input, ``ConfigError`` for a block the engine cannot express (or ``history`` with a
        session or for a workflow), ``SessionBusyError`` when another run holds the session
        (nothing is written then), and whatever made the run fail (after ``run.failed`` is in
        the log).
        """
        runtime, spec = self._spec("run", name)
        return await runtime.run(spec, input, context=context, session_id=session_id,
                                 namespace=namespace, run_id=run_id, history=history)

    def stream(self, name: str, input: Any, *, context: Any = None, session_id: str | None = None,
               namespace: str | None = None, run_id: str | None = None,
               committed: bool = False,
               history: Sequence[HistoryMessage] | None = None) -> AsyncIterator[Event]:
        """Play one turn, yielding its events live: ``run.started``, ``text.delta`` per chunk, ...,
        the terminal event last (yielded once durable).

        Events are yielded as the run produces them, before their batch commits (this reader
        lives and dies with the process). ``committed=True`` yields each only once it is durable
        (what a surface that acknowledges events outside the process must do, as kit_http
        does); the writer then commits as soon as the reader waits, not on its timer.

        The run belongs to the deck, not to the iterator: leaving the loop early ends the stream,
        never the run. Errors as for ``run``; a failed run yields ``run.failed`` and then raises.
        """
        runtime, spec = self._spec("stream", name)
        return runtime.stream(spec, input, context=context, session_id=session_id,
                              namespace=namespace, run_id=run_id, committed=committed,
                              history=history)

    @property
    def store(self) -> EventStorePort:
        """The open deck's event store: read the log through it (``read``, ``follow``, ``runs``,
        ``run_info``); write to it only through the deck. Raises ``DeckStateError`` unless open.
        A tool under trio gets it with its coroutine methods and ``follow`` played on the deck's
        side (its other methods refused: ``DeckStateError``)."""
        return self._open("read the log").store

    async def status(self, run_id: str) -> RunStatus | None:
        """The run's status folded from its events, or None when the log has no such run."""
        return await self._open("read a status").status(run_id)

    def session_for(self, session_id: str, *, namespace: str | None = None) -> Any:
        """The conversation-memory session (an ``agents.memory.Session``) that turns on
        ``session_id`` use. Raises ``DeckStateError`` unless the deck is open."""
        return self._open("get a session").session_for(session_id, namespace)


    # ---------------------------------------------------------------- parked workflows --
    async def pending(self) -> list[Pending]:
        """Every run waiting for a human, across all workflows, read off the log."""
        return await self._open("list pending runs").pending()

    async def answer(self, run_id: str, value: Any, context: Any = None) -> Any:
        """Answer a waiting run: its interrupted node re-runs from its start with ``value``.

        Finds the workflow, thread and session itself. Returns the final state (the run is
        closed, its session freed) or the next ``InterruptResult``. ``context`` is not kept from
        the first call: pass it again. Raises ``UnknownRunError``, ``RunNotWaitingError`` (an
        interrupt is answered once), ``UnknownNameError`` when this deck lacks the workflow.
        """
        return await self._open("answer").answer(run_id, value, context)

    async def pause(self, run_id: str, reason: str | None = None) -> None:
        """Ask a run to pause at its next safe point (before a model call; between a workflow's
        supersteps); returns at once. The request is recorded, in the store, so the process
        playing the run sees it wherever it runs. Raises ``UnknownRunError``."""
        await self._open("pause").request(run_id, "pause", reason, "api")

    async def cancel(self, run_id: str, reason: str | None = None) -> None:
        """Ask a run to end at its next safe point (``run.cancelled``; its session is freed);
        returns at once. A parked run (paused, waiting, sleeping) is cancelled right away.
        Raises ``UnknownRunError``."""
        await self._open("cancel").request(run_id, "cancel", reason, "api")

    def stream_answer(self, run_id: str, value: Any, *, context: Any = None,
                      committed: bool = False) -> AsyncIterator[Event]:
        """``answer``, yielding the run's events live from its ``run.resumed`` on, as ``stream``
        does: ``node.updated`` per node, then the terminal or next parking event.

        The run belongs to the deck: leaving the loop early ends the stream, never the run.
        Errors as for ``answer``, raised at the first iteration; a failed run yields
        ``run.failed``, then raises. ``committed`` as for ``stream``.
        """
        return self._open("answer").stream_answer(run_id, value, context, committed)

    async def resume(self, run_id: str, context: Any = None) -> list[Event]:
        """Continue a paused run here; returns the events it produced (``[]`` when there is
        nothing to resume: the run is not paused, the log has never seen it, another caller
        resumed it first, or this deck lacks its agent or workflow)."""
        return await self._open("resume").resume(run_id, context)

    def stream_resume(self, run_id: str, *, context: Any = None,
                      committed: bool = False) -> AsyncIterator[Event]:
        """``resume``, yielding the run's events live from its ``control.requested`` on, as
        ``stream`` does; yields nothing when there is nothing to resume. Leaving the loop early
        ends the stream, never the run; a failed run yields ``run.failed``, then raises.
        ``committed`` as for ``stream``."""
        return self._open("resume").stream_resume(run_id, context, committed)

    async def due_resumes(self, now: datetime | None = None) -> list[Due]:
        """Sleeping threads whose wake time is at or before ``now`` (default: current UTC),
        read from each workflow's own checkpointer. Raises ``ConfigError`` for a naive ``now``."""
        return await self._open("list due threads").due_resumes(_aware(now))

    async def tick(self, now: datetime | None = None) -> list[Ticked]:
        """Resume every due thread (through its parked run when the log has one); no context.

        Safe to run from several processes at once: a thread is resumed by one of them only.
        A thread whose run fails does not hold up the others: all are resumed, then the first
        failure is raised. Raises ``ConfigError`` for a naive ``now``.
        """
        return await self._open("tick").tick(_aware(now))


def _catalog(arg: str, items: Any, kind: type) -> tuple[Any, ...]:
    """``agents=`` or ``workflows=`` as a tuple. Raises ``ConfigError`` for anything but a
    sequence of ``kind``: a single agent or workflow says to wrap it in a list."""
    if isinstance(items, (Agent, Workflow)):
        param = "agents" if isinstance(items, Agent) else "workflows"
        raise ConfigError(f"Deck({arg}=...) takes a list, got a single {type(items).__name__} "
                          f"{items.name!r}: wrap it in a list, Deck({param}=[...])")
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise ConfigError(f"Deck({arg}=...) takes a list of kit.{kind.__name__} objects, "
                          f"got {type(items).__name__}")
    items = tuple(items)
    for item in items:
        if not isinstance(item, kind):
            raise ConfigError(f"Deck({arg}=...) takes kit.{kind.__name__} objects, got {item!r}")
    return items


def _load_bundle(file: Path, attr: str, kind: type) -> Any:
    """Import a project bundle from its file (no ``sys.path`` change) and return its object.

    The bundle is a package whose directory is its path, so its other files import relatively
    (``from . import tools``); those of a bundle of the same name loaded before are forgotten
    first (another project's ``tools`` is not this one's)."""
    # A dot in the bundle's name (agents/chat.v2) would make its module a submodule of a package
    # no bundle is: `from . import x` looked for kit_project_agents_chat. It is a "_" here.
    name = f"kit_project_{file.parent.parent.name}_{file.parent.name.replace('.', '_')}"
    for stale in [m for m in sys.modules if m.startswith(f"{name}.")]:
        del sys.modules[stale]
    try:
        spec = importlib.util.spec_from_file_location(
            name, file, submodule_search_locations=[str(file.parent)])
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        # In sys.modules while it runs, as an import would: a dataclass or a TypedDict's hints
        # under `from __future__ import annotations` are resolved through it.
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as exc:  # a bundle that exits (argparse at import) too
        sys.modules.pop(name, None)
        raise ConfigError(f"{file} failed to import: {type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if not isinstance(found, kind):
        raise ConfigError(f"{file} must define a module-level {attr!r} (a kit.{kind.__name__}), "
                          f"found {type(found).__name__}")
    return found


def _alias_core() -> None:
    # SPEC documents `kit.core` and `kit.core.ports` as import paths: the values' module.
    import kit_core
    sys.modules.setdefault(f"{__name__}.core", kit_core)
    sys.modules.setdefault(f"{__name__}.core.ports", kit_core)
    kit_core.ports = kit_core  # type: ignore[attr-defined]  # kit.core.ports.X, as a submodule's


_alias_core()
