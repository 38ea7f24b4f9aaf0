"""kit_workflows: the LangGraph engine: workflows compiled, played on a run handle, parked, woken.

Owns: compiling a ``Workflow`` for Deck runs (``compile_workflow``: a copy of its graph whose nodes
that declare a ``Context`` receive the run's, a compiled subgraph's too), what an input or an
answer may hold
(``WorkflowEngine.to_input`` and ``check_answer``: ``INT_RANGE``, ``MAX_DEPTH``), playing and
resuming a run (``WorkflowEngine.play``), reading sleeping threads off a checkpointer
(``sleeping_until``, ``sleeping_threads``), the headless ``Workflow.run``/``resume``
(``run_headless``) and workflow-as-tool (``workflow_tool``).

Must never: reach the event store or the Runtime (a run is played through the ``RunHandle`` it is
given; a child run starts through ``RunHandle.start_child``), import kit_runtime or anything above
it, touch asyncio directly, open a checkpointer (kit_threads, below, holds them: ``open_graphs``,
and the classes a checkpoint may rebuild: ``allow_named``, ``classes_in``), or put the
application context in state, config or a checkpoint.

Theory of operation
-------------------
A run streams the graph with ``stream_mode=["updates", "values"]``: each node's update becomes
``node.updated``; an ``__interrupt__`` update parks the run (``run.interrupted``, or
``run.sleeping`` for ``sleep_until``; of parallel nodes' interrupts, ``_waits_on``'s); the last
values are the output of ``run.completed``. The caller's context travels in LangGraph's run
context (``context=``), never in state or config, so it never reaches a checkpoint
(notes/ENGINES.md 12). Pause and cancel drain the graph at its next superstep boundary
(``RunControl.request_drain``); the checkpoint is saved, so a paused run resumes where it
stopped. Durable runs use ``durability="sync"``: a checkpoint is on disk before the next
superstep starts, and is written only once the run's log holds what came before it
(``kit_threads.PLAYING``), so a run reaped while its process stalled writes none. A non-durable
run uses ``durability="exit"``: it writes its thread once, as it stops (parks, is drained, ends),
no checkpoint a step (those of a run that completes were deleted at once, for most of kit's cost
of a run; nothing reads a thread while its run plays). Its thread lives only while the run does:
when the run ends (completed, failed, cancelled) its
checkpoints are deleted (a durable run's too when its thread is its own run id: a child run's, which
no later run reaches); while it is parked (waiting for a human, asleep, paused) they stay, for the
run that resumes it, so only the process that parked it can (``holds_thread``). A durable run that
is cancelled or fails drops the tasks it stopped at, so no tick wakes its sleep, and the next run on
its thread applies its input (LangGraph discards any task left); only after a run whose process died
(the Runtime reads that off the log: ``abandoned``) does the next run carry on from the last
checkpoint, with the answer its run had taken (saved before its node ran: ``_keep_answer``). A
thread whose state LangGraph cannot read any more (it no longer fits the state schema) is deleted by
the next run, which starts it afresh (``_stuck``). A sleep is an interrupt of exactly ``{"kind":
"sleep", "until": <aware ISO time>}``; any other is a human's question. A value a checkpoint cannot
store fails the run at its first checkpoint, once the run is in the log (an answered one for good:
its interrupt cannot be answered again), so an input or an answer is checked before anything is
written (``to_input``, ``check_answer``) and refused as a ``ContentError``.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio

from kit_bridge import on_asyncio
from kit_content import check_inline_json, check_unicode
from kit_context import context_params, node_function
from kit_core import (
    ConfigError, ContentError, Context, ControlRequested, DataBlock, Event, InterruptResult,
    InvocableSpec, NodeUpdated, RunCancelled, RunCompleted, RunHandle, RunInterrupted,
    RunNotWaitingError, RunPaused, RunSleeping, RunStatus, Usage, error_text, jsonable,
    new_run_id,
)
from kit_threads import (
    PLAYING, allow_named, allow_types, checkpoint_serde, classes_in, thread_config,
)

if TYPE_CHECKING:
    from kit_catalog import Workflow

__all__ = ("compile_workflow", "WorkflowEngine", "INT_RANGE", "MAX_DEPTH", "resume_command",
           "sleeping_until", "sleeping_threads", "run_headless", "workflow_tool", "child_tool")

_log = logging.getLogger("kit.workflows")
_CONTROL_WRITES = {"__interrupt__", "__resume__", "__error__", "__error_source_node__"}
_NULL_TASK = "00000000-0000-0000-0000-000000000000"
_NO_VALUE = object()
#: What LangGraph injects into a node by parameter name, read off its ``Runtime`` instead.
_FROM_RUNTIME = {"runtime": lambda r: r, "writer": lambda r: r.stream_writer,
                 "store": lambda r: r.store, "previous": lambda r: r.previous}


# ================================================================================ compiling ====

#: The integers LangGraph's checkpoint serializer (msgpack) stores. A state or an answer with
#: another would fail the run at its first checkpoint, so it is refused before the run starts
#: or is taken over.
INT_RANGE = (-2**63, 2**64 - 1)
#: How deep a state or an answer may nest (``[]`` is one level, ``[[]]`` two). The serializer
#: (ormsgpack) refuses data nested more than 255 levels, and LangGraph stores a value a level or
#: two below the top (an answer in its task's list of resume values, a state key under a SQLite
#: checkpoint's ``channel_values``): deeper data would fail the run at a checkpoint, so it is
#: refused with the integers. A few levels are kept spare for a node that wraps the value.
MAX_DEPTH = 250


def _check_data(what: str, value: Any) -> None:
    """Raise ``ContentError`` naming ``what`` for ``value`` holding an integer outside
    ``INT_RANGE``, a NaN or an infinity (which the log cannot write as JSON, once a node passes
    it on), text with a lone surrogate (not UTF-8: a durable checkpoint stores it as ``?``, so a
    node would be given another value), or nested deeper than ``MAX_DEPTH`` (a container that
    holds itself too)."""
    low, high = INT_RANGE
    stack: list[tuple[Any, int]] = [((value,), 0)]  # containers to look into, and their depth
    while stack:  # iterative: an answer from Python may nest deeper than the recursion limit
        items, depth = stack.pop()
        for v in items:
            if isinstance(v, int):
                if not low <= v <= high:
                    raise ContentError(f"{what} holds an integer beyond 64 bits, which "
                                       "LangGraph's checkpoints cannot store; send it as a string")
            elif isinstance(v, str):
                check_unicode(what, v)
            elif isinstance(v, float):
                if v - v != 0.0:
                    raise ContentError(f"{what} holds {v!r}, which the log cannot write as JSON "
                                       "(it has no NaN nor infinity); send None or a string")
            elif isinstance(v, (Mapping, list, tuple, set, frozenset)):
                if depth == MAX_DEPTH:  # a container that holds itself ends here too
                    raise ContentError(f"{what} is nested too deep for LangGraph's checkpoints "
                                       f"(more than {MAX_DEPTH} levels)")
                inner = [*v.keys(), *v.values()] if isinstance(v, Mapping) else v
                stack.append((inner, depth + 1))


class WorkflowEngine:
    """A compiled workflow: the deck's copy of its graph (nodes that take a ``Context`` bound to
    LangGraph's run context), its input check and its thread key scheme.

    Checkpoint threads are keyed ``<workflow>:<namespace>:<thread id>`` so workflows and
    namespaces never share a thread, and a checkpointer scan can tell whose thread it sees. The
    graph is compiled when the deck opens, with its checkpointer (``kit_threads.open_graphs``).
    """

    def __init__(self, name: str, graph: Any, durable: bool) -> None:
        self.name, self.graph, self.durable = name, graph, durable

    def to_input(self, input: Any) -> DataBlock:
        """The initial state, as the ``DataBlock`` its ``run.started`` records (``.data``: the
        state). Raises ``ContentError`` for a non-mapping or non-JSON input (over the inline
        cap too), or one its checkpoints could not store."""
        if not isinstance(input, Mapping):
            raise ContentError(f"workflow {self.name!r} takes a mapping (its initial "
                               f"state) as input, got {type(input).__name__}")
        what = f"the input of workflow {self.name!r}"
        try:
            block = DataBlock(dict(input))
        except ContentError:  # said again in a caller's terms: an HTTP client has no DataBlock
            check_inline_json(what, dict(input), "(a URI or an id) in the state")
            raise
        _check_data(what, block.data)
        return block

    def check_answer(self, value: Any) -> None:
        """Raise ``ContentError`` for an answer its checkpoint or the log could not store: one
        holding an integer beyond 64 bits, a NaN or an infinity, a lone surrogate, nested
        deeper than ``MAX_DEPTH`` (or holding itself), or an object LangGraph's serializer has no
        encoding for (an instance of a plain class). Checked before the parked run is taken
        over, so a bad answer leaves it waiting.

        Anything the serializer stores is a good answer (JSON data, sets, tuples, bytes,
        datetimes, dataclasses, pydantic models, ...). The log needs nothing more: it holds the
        answer only as the nodes pass it on, through ``jsonable`` (which writes what it does not
        know as its ``str``), and data within ``MAX_DEPTH`` is far inside the recursion limit.
        """
        what = f"the answer to workflow {self.name!r}"
        _check_data(what, value)  # first: these limits said in kit's words, not msgpack's
        try:  # the very bytes LangGraph writes: the answered task's list of resume values
            checkpoint_serde().dumps_typed([value])
        except TypeError as exc:  # ormsgpack's error, which wraps what an object's encoding raised
            raise ContentError(f"{what} cannot be stored in LangGraph's checkpoints ({exc}); "
                               "send JSON data") from None
        allow_types(classes_in(value))  # the node that takes it gets it back as it was sent

    def key(self, namespace: str | None, thread_id: str) -> str:
        return f"{self.name}:{namespace or ''}:{thread_id}"

    async def play(self, run: RunHandle, graph: Any, inp: Any, *, abandoned: bool = False
                   ) -> Event:
        """Engine side: play (or resume) ``run`` on the compiled ``graph``, ending it with a
        terminal or parking event (durable when this returns).

        ``inp`` is the initial state, or a ``resume_command``. ``abandoned``: the log says the
        thread's previous run was abandoned (its process died, an answer it took included), so
        a new run on a durable thread that stopped mid-run carries on from the last checkpoint
        and the new input is not applied; otherwise the input is applied and LangGraph discards
        whatever tasks the thread stopped at. A run's failure is recorded, then re-raised. A
        cancel asked for while the run's last step was on its way to an interrupt cancels it
        there instead of parking it. A run that ends gives up its thread (``forget``; a
        non-durable one's in-memory saver deletes it at once, with no await); one that parks
        keeps it for the run that resumes it.
        """
        from langgraph.errors import GraphDrained
        from langgraph.runtime import RunControl
        control = RunControl()
        run.on_request = control.request_drain
        if run.requested is not None:  # asked before the graph started
            control.request_drain(run.requested[0])
        parks = completed = False  # parks: its thread is kept for the run that resumes it
        playing = PLAYING.set(run)
        try:
            try:
                final, interrupts = await self._stream(run, graph, inp, control, abandoned)
                # Made here, so a payload or a final state the log cannot write (a NaN) fails
                # the run like a node's error, instead of leaving it running with no end.
                cancel = bool(interrupts) and (run.requested or ("",))[0] == "cancel"
                end = None if cancel else (_parked(run, interrupts) if interrupts
                                           else RunCompleted(jsonable(final), Usage()))
            except GraphDrained:  # stopped at a superstep boundary, as asked; checkpoint saved
                action, reason, source = run.take_request() or ("pause", None, None)
                parks = action != "cancel"
                return await _stopped(run, action, reason, source)
            except anyio.get_cancelled_exc_class():
                if (end := run.ending()) is not None:
                    run.emit(end)
                raise
            except BaseException as exc:  # (not a cancellation: above) a user's BaseException too
                run.error = exc
                await run.durable(run.failure(exc))
                raise
            finally:
                run.on_request = None
            if end is None:  # a cancel asked while the last step headed for an interrupt
                return await _stopped(run, *run.take_request())  # type: ignore[misc]
            parks, completed = bool(interrupts), not interrupts
            return await run.durable(end)
        finally:
            own = run.session_id is None  # its thread is its run id: no later run reaches it
            # A durable run that completed leaves no task: its thread is kept for the next run.
            try:
                if parks or completed and self.durable and not own:
                    pass
                elif not self.durable:  # its in-memory saver's: gone at once, nothing to await
                    graph.checkpointer.delete_thread(run.thread_key)
                else:
                    with anyio.CancelScope(shield=True):  # a cancelled run ends too
                        await self.forget(graph, run.thread_key, whole=own)
            finally:
                PLAYING.reset(playing)

    async def forget(self, graph: Any, key: str, whole: bool = False) -> None:
        """Engine side: thread ``key``'s run ended (cancelled or failed; a non-durable one
        completed too) and nothing will resume it: ``play`` calls this, and so does the Runtime
        when it cancels a parked run. A non-durable thread is deleted (an in-memory one would
        stay for the life of the process). A durable one keeps its state but drops the tasks its
        run stopped at (LangGraph's ``update_state(None, as_node=END)``), so the next run on
        it starts from its own input and no ``tick`` wakes a sleep that was cancelled or
        failed. A failure here is logged: the next run still applies its own input, and LangGraph
        discards the tasks then. ``whole``: the thread is a run's own (no
        session: a child run's), which no later run reaches, so a durable one is deleted too."""
        if not self.durable or whole:
            await graph.checkpointer.adelete_thread(key)
            return
        config = thread_config(key)
        try:
            if (await graph.aget_state(config)).next:
                await graph.aupdate_state(config, None, as_node="__end__")
        except Exception as exc:  # its type only: a state's error (pydantic's) quotes the state
            _log.warning("workflow %s: could not drop the stopped tasks of thread %r: %s",
                         self.name, key, type(exc).__name__)

    async def _stream(self, run: RunHandle, graph: Any, inp: Any, control: Any,
                      abandoned: bool) -> tuple[Any, Any]:
        """Stream the graph on ``run``'s thread, recording each node's update: the last state
        and the interrupts it stopped on (empty when it ran to its end)."""
        config = thread_config(run.thread_key)
        head = None  # the thread's checkpoint before this run applies its input
        if self.durable and isinstance(inp, dict):
            # Carried on only after a process that died (the log says so, ``abandoned``): an
            # answered question still counts as pending in LangGraph, and a failed run whose
            # tasks ``forget`` could not drop left them too.
            if abandoned and await self._stopped_tasks(graph, config):
                inp = None
            else:
                head = await graph.checkpointer.aget_tuple(config)
        elif isinstance(inp, dict) and run.session_id is not None and \
                graph.checkpointer.get_tuple(config) is not None:  # (an in-memory saver's)
            # A new run starts afresh, whatever was left; one with no session has a thread of
            # its own (its run id, which the log gives no other run), never played before.
            await self.forget(graph, run.thread_key)
        elif isinstance(getattr(inp, "resume", None), dict):  # by interrupt id
            inp = await _woken(graph, config, inp)
            if self.durable:
                await _keep_answer(graph, config, inp.resume)
        seen: list[str] = []  # the first chunk's mode, once the graph streamed one
        try:
            return await self._chunks(run, graph, inp, config, control, seen)
        except Exception:
            # Before its first chunk (no node ran) and its input's checkpoint, as it discarded
            # the tasks the thread stopped at: if LangGraph cannot read the thread's state
            # either, that state no longer fits the graph (a pydantic state given a bad type),
            # and every later run would fail the same way, whatever its input: the thread goes,
            # and the run starts it afresh, once.
            if seen or head is None or not await self._stuck(graph, config, head):
                raise
        _log.warning("workflow %s: thread %r was deleted: LangGraph can read neither its state "
                     "nor the tasks it stopped at; the new run starts it afresh",
                     self.name, run.thread_key)
        await graph.checkpointer.adelete_thread(run.thread_key)
        return await self._chunks(run, graph, inp, config, control, seen)

    @staticmethod
    async def _stopped_tasks(graph: Any, config: Any) -> bool:
        """Whether the thread stopped at tasks (False when LangGraph cannot read its state:
        a run that applies its input deletes it then, ``_stuck``)."""
        try:
            return bool((await graph.aget_state(config)).next)
        except Exception:
            return False

    @staticmethod
    async def _stuck(graph: Any, config: Any, head: Any) -> bool:
        """Whether the checkpointer reads the thread still at ``head`` (it works, and the run
        saved nothing) and LangGraph cannot make its state of it: only the thread as it was
        before the run is at fault then, not a passing outage nor the run's own input."""
        try:
            now = await graph.checkpointer.aget_tuple(config)
        except Exception:
            return False
        if now is None or now.config["configurable"].get("checkpoint_id") != \
                head.config["configurable"].get("checkpoint_id"):
            return False
        try:
            await graph.aget_state(config)
        except Exception:
            return True
        return False

    async def _chunks(self, run: RunHandle, graph: Any, inp: Any, config: Any, control: Any,
                      seen: list[str]) -> tuple[Any, Any]:
        """``_stream``'s stream of the graph (its first chunk's mode noted in ``seen``): the
        last state and the interrupts."""
        interrupts: dict[str, Any] = {}  # by id, every task's: parallel ones each have a chunk
        final: Any = None
        # A node's empty update waits for the stream's next chunk: LangGraph also reports one
        # for a resumed node that then fails (its resume write hides its error write), and
        # raises right after it, so no failed node is recorded as updated.
        empty: list[str] = []
        # A resume outputs again the updates of the nodes that finished in the superstep the
        # graph stopped in (beside an interrupt), marked ``__metadata__: {"cached": True}``: a
        # run that played before (past its run.started) recorded them then; a new run that
        # carries a thread on records them as its own.
        played = run.seq > 0
        async for mode, chunk in graph.astream(
                inp, config, context=run.data, control=control,
                stream_mode=["updates", "values"], durability="sync" if self.durable else "exit"):
            if not seen:
                seen.append(mode)
            self._updated(run, empty)
            if mode == "values":
                final = chunk
                continue
            if chunk.pop("__metadata__", None) is not None and played:
                continue
            for node, update in chunk.items():
                if node == "__interrupt__":
                    if not update:  # a static breakpoint: no question, no id to answer it by
                        raise ConfigError(
                            f"workflow {self.name!r} stopped at a breakpoint (a subgraph's "
                            "interrupt_before or interrupt_after), which no answer can reach: "
                            "ask with kit.interrupt() in the node instead")
                    interrupts.update((i.id, i) for i in update if i.id not in interrupts)
                elif update is None:
                    empty.append(node)
                else:
                    run.emit(NodeUpdated(node, jsonable(update)), origin=f"{run.origin}/{node}")
            await run.pace()  # never far ahead of the log
        self._updated(run, empty)
        keys = graph.output_channels  # what LangGraph's invoke returns: the output schema's keys
        if isinstance(final, dict) and not isinstance(keys, str):  # (astream's values hold all)
            final = {k: final[k] for k in keys if k in final}
        return final, list(interrupts.values())

    @staticmethod
    def _updated(run: RunHandle, nodes: list[str]) -> None:
        """Record the empty updates of ``nodes`` (the stream went on past them), and forget them."""
        for node in nodes:
            run.emit(NodeUpdated(node, None), origin=f"{run.origin}/{node}")
        nodes.clear()


async def _stopped(run: RunHandle, action: str, reason: str | None, source: str | None) -> Event:
    """End ``run`` as asked: its request recorded, then ``run.paused`` or ``run.cancelled``."""
    run.emit(ControlRequested(action, reason, source))
    return await run.durable(RunCancelled(reason) if action == "cancel" else RunPaused(reason))


def resume_command(interrupt_id: str, value: Any) -> Any:
    """What ``WorkflowEngine.play`` takes to answer (or wake) the interrupt ``interrupt_id``."""
    from langgraph.types import Command
    return Command(resume={interrupt_id: value})


def _parked(run: RunHandle, interrupts: Sequence[Any]) -> Any:
    intr = _waits_on(interrupts)
    if _sleeps_until(intr.value) is not None:
        return RunSleeping(intr.value["until"], run.thread_id, intr.id)
    return RunInterrupted(intr.id, jsonable(intr.value), run.thread_id)


def _waits_on(interrupts: Sequence[Any]) -> Any:
    """The one of a step's ``interrupts`` (parallel nodes each stop on their own) that its run
    parks on, and that an answer or a tick takes: the first question, else the earliest sleep.

    A question first, so a human is asked at once, whatever the other nodes sleep: the step
    ends only once each of its tasks has, so the run waits for both anyway. The sleeping node
    runs again once the question is answered, and sleeps again until its time (the time is in
    its state), so an answer before then keeps it asleep; the orphan scan passes over a thread
    a question waits on (``sleeping_threads``). The earliest sleep, so no tick wakes a later
    one early: each runs again, and the others sleep on (``_earliest_sleep``)."""
    questions = [i for i in interrupts if _sleeps_until(i.value) is None]
    return questions[0] if questions else _earliest_sleep(interrupts)


def _earliest_sleep(interrupts: Sequence[Any]) -> Any:
    """The sleep of ``interrupts`` due first (None when none sleeps)."""
    return min((i for i in interrupts if _sleeps_until(i.value) is not None),
               key=lambda i: _sleeps_until(i.value), default=None)


def _sleeps_until(value: Any) -> datetime | None:
    """When an interrupt's ``value`` sleeps until: ``sleep_until``'s ``{"kind": "sleep",
    "until": <timezone-aware ISO time>}``, exactly; None for anything else, which is a question
    for a human (``interrupt({"kind": "sleep", "until": "after lunch?"})`` is one)."""
    if not (isinstance(value, dict) and value.keys() == {"kind", "until"}
            and value["kind"] == "sleep" and isinstance(value["until"], str)):
        return None
    try:
        until = datetime.fromisoformat(value["until"])
    except ValueError:
        return None
    return until if until.utcoffset() is not None else None


def _bind_context(workflow: str, name: str, fn: Callable[..., Any], ctx_names: list[str]) -> Any:
    """A node that hands ``fn`` the run's context as ``Context(runtime.context)``.

    The context travels in LangGraph's run context (``astream(context=)``), never in state or
    config, so it never reaches a checkpoint (notes/ENGINES.md 12). The raw ``fn`` stays in the
    workflow's own graph: headless runs call it without a context and fail with Python's own
    ``TypeError`` for the missing argument (SPEC 7).
    """
    params = inspect.signature(fn).parameters
    if "config" in params:
        raise ConfigError(f"node {name} of workflow {workflow!r} takes both a Context and config; "
                          "read what you need from the Context instead")
    injected = [n for n in _FROM_RUNTIME if n in params]

    def kwargs(runtime: Any) -> dict[str, Any]:
        out = {n: _FROM_RUNTIME[n](runtime) for n in injected}
        out.update({n: Context(runtime.context) for n in ctx_names})
        return out

    # A node kept as an object whose ``__call__`` is async is awaited too, as LangGraph does.
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        async def node(state: Any, runtime: Any) -> Any:
            return await fn(state, **kwargs(runtime))
    else:
        def node(state: Any, runtime: Any) -> Any:
            return fn(state, **kwargs(runtime))
    node.__name__ = getattr(fn, "__name__", name)
    return node


def compile_workflow(workflow: Workflow) -> InvocableSpec:
    """Check a ``Workflow`` for Deck runs and make the deck's copy of its graph, whose nodes
    that declare a ``Context`` receive the run's (inside a compiled subgraph too). Raises
    ``ConfigError`` for a graph that does not compile, a node that takes both a Context and
    ``config``, or a subgraph compiled with a breakpoint (``interrupt_before``/``_after``: no
    answer can reach one, so a run would stop there as if it had ended)."""
    name = workflow.name
    deck_graph = _bound(name, workflow.graph, "", set()) or _copy_graph(workflow.graph)
    try:
        deck_graph.compile()  # a graph that cannot compile is a configuration error now
    except Exception as exc:
        raise ConfigError(f"workflow {name!r} does not compile: {exc}") from None
    allow_named(workflow.graph)
    return InvocableSpec(name, "workflow", workflow, WorkflowEngine(name, deck_graph, workflow.durable))


def _copy_graph(graph: Any) -> Any:
    out = copy.copy(graph)
    out.nodes = dict(graph.nodes)
    return out


def _bound(workflow: str, graph: Any, path: str, above: set[int]) -> Any:
    """A copy of ``StateGraph`` ``graph`` whose nodes that declare a ``Context`` are bound to
    the run's (``_bind_context``), or None when none does. A node that is a compiled subgraph
    is compiled again, as it was, from such a copy of its builder: LangGraph hands a subgraph
    its parent's run context, so its nodes read the run's too. ``path``: where ``graph`` is
    (``inner/`` for a subgraph's nodes, as in an event's origin); ``above``: the builders
    that hold it (a builder that holds its own compiled graph is bound once). Raises
    ``ConfigError`` for a subgraph compiled with a breakpoint."""
    from langgraph._internal._runnable import coerce_to_runnable
    from langgraph.graph.state import CompiledStateGraph
    if id(graph) in above:
        return None
    out = None
    for node_name, node in graph.nodes.items():
        runnable = None
        if isinstance(sub := node.runnable, CompiledStateGraph) and (
                sub.interrupt_before_nodes or sub.interrupt_after_nodes):
            raise ConfigError(f"workflow {workflow!r}: subgraph {path}{node_name} stops at a "
                              "breakpoint (interrupt_before or interrupt_after), which no answer "
                              "can reach: ask with kit.interrupt() in its node instead")
        fn = node_function(node)
        if ctx_names := list(context_params(fn)) if fn is not None else []:
            runnable = coerce_to_runnable(_bind_context(workflow, path + node_name, fn, ctx_names),
                                          name=node_name, trace=False)
        elif isinstance(sub, CompiledStateGraph) and (
                builder := _bound(workflow, sub.builder, f"{path}{node_name}/",
                                  above | {id(graph)})) is not None:
            runnable = builder.compile(
                sub.checkpointer, cache=sub.cache, store=sub.store, name=sub.name,
                interrupt_before=sub.interrupt_before_nodes, debug=sub.debug,
                interrupt_after=sub.interrupt_after_nodes, transformers=sub.stream_transformers)
        if runnable is not None:
            out = out or _copy_graph(graph)
            out.nodes[node_name] = dataclasses.replace(node, runnable=runnable)
    return out


def _pending_interrupts(ct: Any) -> list[Any]:
    """Interrupts still waiting in a checkpoint (LangGraph's own rule, notes/ENGINES.md 10):
    a task's INTERRUPT slot holds its latest question; it is pending while the task has no
    output write. (A ``__resume__`` write does not mean the question was answered.)"""
    asked: dict[str, list[Any]] = {}
    finished: set[str] = set()
    for task_id, channel, value in ct.pending_writes or ():
        if task_id == _NULL_TASK:
            continue
        if channel == "__interrupt__":
            asked[task_id] = list(value) if isinstance(value, (list, tuple)) else [value]
        elif channel not in _CONTROL_WRITES:
            finished.add(task_id)
    return [i for t, found in asked.items() if t not in finished for i in found]


async def _woken(graph: Any, config: dict[str, Any], command: Any) -> Any:
    """``command``, and when it is a tick's wake (``{"woke_at": <iso time>}`` to a sleep of the
    thread), one that wakes every sleep of the thread due by then: parallel nodes asleep to one
    time (a fan-out's) woke one a tick, the run parked again on the next, so the last of ten woke
    nine ticks late."""
    from langgraph.types import Command
    (woken, value), = command.resume.items() if len(command.resume) == 1 else ((None, None),)
    if not (isinstance(value, dict) and value.keys() == {"woke_at"}
            and isinstance(value["woke_at"], str)):
        return command
    try:
        now = datetime.fromisoformat(value["woke_at"])
        ct = await graph.checkpointer.aget_tuple(config)
    except Exception:  # not a tick's; or the thread cannot be read, and the run will say so
        return command
    sleeps = {i.id: _sleeps_until(i.value) for i in (_pending_interrupts(ct) if ct else ())}
    if sleeps.get(woken) is None or now.utcoffset() is None:
        return command
    # Only those due: the one the log names is (a run an older kit parked on the later of two
    # sleeps named that one, woken then at the other's time).
    due = {i: value for i, until in sleeps.items() if until is not None and until <= now}
    return Command(resume=due) if due else command


async def _keep_answer(graph: Any, config: dict[str, Any], resume: dict[str, Any]) -> None:
    """Save the answers (or the wake) ``resume`` holds by interrupt id in the thread's latest
    checkpoint, as the resume values of the tasks that asked, before the graph runs: LangGraph
    keeps such an answer in memory until its node ends, so a process that died while the
    answered node ran lost it, and the run that carried the thread on asked again."""
    for at, interrupt_id, task, answers in await _asked(graph, config, resume):
        await graph.checkpointer.aput_writes(at, [("__resume__", [*answers, resume[interrupt_id]])],
                                             task)


async def _asked(graph: Any, config: dict[str, Any], interrupt_ids: typing.Iterable[str]
                 ) -> list[tuple[Any, str, str, list[Any]]]:
    """Where questions ``interrupt_ids`` of the thread wait, as ``(checkpoint config, interrupt
    id, the task that asked, the answers that task holds)``: in the thread's latest checkpoint,
    and in each subgraph's it stopped in (a question asked inside a subgraph is its own task's,
    in the subgraph's checkpoint; the parent's task that ran it has it only as a copy)."""
    configs = [config]
    try:
        snapshots = [await graph.aget_state(config, subgraphs=True)]
    except Exception:  # a state LangGraph cannot read: the run fails, or the thread goes
        snapshots = []
    while snapshots:  # the subgraphs the thread stopped in, at any depth
        for task in snapshots.pop().tasks:
            if task.state is not None and hasattr(task.state, "tasks"):
                configs.append(task.state.config)
                snapshots.append(task.state)
    out = []
    for ct in [await graph.checkpointer.aget_tuple(c) for c in configs]:
        writes = ct.pending_writes or () if ct is not None else ()
        for interrupt_id in interrupt_ids:
            asked = next((task for task, channel, found in writes if channel == "__interrupt__"
                          and any(getattr(i, "id", None) == interrupt_id for i in
                                  (found if isinstance(found, (list, tuple)) else [found]))), None)
            if asked is not None:
                answered = next((list(v) if isinstance(v, list) else [v] for task, channel, v
                                 in writes if task == asked and channel == "__resume__"), [])
                out.append((ct.config, interrupt_id, asked, answered))
    return out


async def sleeping_until(graph: Any, key: str) -> tuple[datetime, str] | None:
    """Engine side: when thread ``key`` of ``graph`` sleeps until, and the interrupt that wakes
    it (its earliest sleep: ``_waits_on``), read off its latest checkpoint; None when it does
    not sleep. A question waiting beside the sleep does not count here: a run parks on the
    question then (and is not ``SLEEPING``), but a run a kit before this parked ``SLEEPING``
    beside one is woken, then asks it."""
    ct = await graph.checkpointer.aget_tuple(thread_config(key))
    intr = _earliest_sleep(_pending_interrupts(ct) if ct is not None else ())
    until = None if intr is None else _sleeps_until(intr.value)
    return None if until is None else (until, intr.id)


async def sleeping_threads(graphs: dict[str, Any]) -> list[tuple[str, str]]:
    """Engine side: every thread of the graphs' checkpointers whose latest root checkpoint
    sleeps and no question waits on (a run of it parks on the question: ``_waits_on``), as
    ``(thread key, workflow)``: a scan of every checkpoint they hold."""
    savers = {id(g.checkpointer): g.checkpointer for g in graphs.values()}
    out = []
    for saver in savers.values():
        seen: set[str] = set()
        async for ct in saver.alist(None):  # newest first, per thread
            conf = ct.config["configurable"]
            key = conf["thread_id"]
            if conf.get("checkpoint_ns", "") or key in seen:
                continue
            seen.add(key)
            name = key.split(":", 1)[0]
            waiting = _pending_interrupts(ct)
            if name in graphs and waiting and _sleeps_until(_waits_on(waiting).value) is not None:
                out.append((key, name))
    return out


# ============================================================================ headless, tools ====

async def run_headless(graph: Any, name: str, input: Any, thread_id: str | None,
                       resume: Any = _NO_VALUE, *, own: set[str]) -> Any:
    """``Workflow.run`` / ``resume``: LangGraph's own run of ``graph``, no log; the final state
    or an ``InterruptResult``. Raises ``ContentError`` for a non-mapping input, and (``resume``)
    ``RunNotWaitingError`` naming the thread when no question waits on it (it was never played,
    it ended, or its question was answered already): LangGraph would start an empty thread over
    from START, and give an ended one's state back as if the answer had been taken.

    ``own`` holds the parked threads the workflow made itself (a run given no ``thread_id``):
    such a thread is deleted when its run ends, since no caller holds its id to go on with it
    (a failed ``resume`` keeps it: the caller holds the id and may answer again, and the
    question waits for that answer, not the failed one: ``_unanswer``)."""
    thread = thread_id or new_run_id()
    if resume is _NO_VALUE and not isinstance(input, Mapping):
        raise ContentError(f"workflow {name!r} takes a mapping as input, "
                           f"got {type(input).__name__}")
    ours = thread_id is None or thread_id in own
    # What a checkpoint may give back to its nodes, as a deck's (headless input need not be JSON).
    allow_named(graph.builder)
    allow_types(classes_in(input if resume is _NO_VALUE else resume))

    async def play() -> Any:
        held: list[Any] = []  # (resume) the answers the tasks that asked held
        if resume is _NO_VALUE:
            inp: Any = dict(input)
        else:
            # The question its InterruptResult showed, by id: with several waiting (parallel
            # nodes) LangGraph refuses an answer that names none.
            state = await graph.aget_state(thread_config(thread))
            if not state.interrupts:
                raise RunNotWaitingError(thread, "unknown" if state.created_at is None else
                                         RunStatus.COMPLETED if not state.next else
                                         RunStatus.FAILED, RunStatus.WAITING_HUMAN.value)
            asked = _waits_on(state.interrupts).id
            inp = resume_command(asked, resume)
            held = await _asked(graph, thread_config(thread), [asked])
        try:
            out = await graph.ainvoke(inp, thread_config(thread))
        except BaseException as exc:
            if thread_id is None:  # nobody has its id
                await graph.checkpointer.adelete_thread(thread)
            elif held and isinstance(exc, Exception):  # the question waits for another answer
                await _unanswer(graph, thread_config(thread), held)
            raise
        if isinstance(out, dict) and out.get("__interrupt__"):
            if ours:
                own.add(thread)
            # What ``resume`` answers, read as it does: ``out`` lists the step's interrupts in
            # another order than the thread's state (a parallel node's question was shown,
            # and the answer went to another node's).
            found = (await graph.aget_state(thread_config(thread))).interrupts
            return InterruptResult(_waits_on(found).value, thread)
        if ours:
            own.discard(thread)
            await graph.checkpointer.adelete_thread(thread)
        return out

    return await on_asyncio(play)


async def _unanswer(graph: Any, config: dict[str, Any],
                    held: list[tuple[Any, str, str, list[Any]]]) -> None:
    """After an answer whose node failed, give the tasks that asked (``held``: ``_asked`` before
    the answer) back the answers they held then: LangGraph keeps a failed task's answers for a
    retry, and its node reads the first answer to a question, so every later answer would
    replay the failed one."""
    before = {task: answers for _, _, task, answers in held}
    for at, _, task, answers in await _asked(graph, config, {i for _, i, _, _ in held}):
        if task in before and len(answers) > len(before[task]):
            await graph.checkpointer.aput_writes(at, [("__resume__", before[task])], task)


def workflow_tool(name: str, graph: Any, description: str | None,
                  play: Callable[[Any, dict[str, Any]], Awaitable[Any]]) -> Any:
    """An SDK ``FunctionTool`` whose arguments are the workflow's input state.

    ``play(run_context, args)`` plays it (``run_context`` is the calling run's SDK context); the
    model gets the final state as JSON, word that the workflow is waiting and for what, or (as
    for any tool) the error when it failed or was stopped.
    """
    import agents as sdk
    try:
        schema = graph.compile().get_input_jsonschema()
    except Exception:  # e.g. pydantic refuses typing.TypedDict before Python 3.12: name the keys
        keys = typing.get_type_hints(graph.input_schema)
        schema = {"type": "object", "properties": {k: {} for k in keys}}

    async def invoke(tool_ctx: Any, args_json: str) -> str:
        try:
            out = await play(tool_ctx.context, json.loads(args_json or "{}"))
        except Exception as exc:  # a failed or stopped workflow: the model is told, as for any tool
            run = tool_ctx.context
            if isinstance(run, RunHandle):
                run.tool_errors.add(getattr(tool_ctx, "tool_call_id", ""))
            return f"error: {type(exc).__name__}: {error_text(exc)}"
        if isinstance(out, InterruptResult):
            return (f"workflow {name} is waiting (thread {out.thread_id}): "
                    f"{json.dumps(jsonable(out.payload))}")
        return json.dumps(jsonable(out))

    return sdk.FunctionTool(name=name, description=description or graph.__doc__ or f"Run the {name} workflow.",
                            params_json_schema=schema, on_invoke_tool=invoke, strict_json_schema=False)


def child_tool(spec: InvocableSpec) -> Any:
    """Workflow ``spec`` as a tool of a deck's agent: each call plays it through the Runtime as
    a child run of the calling run (own run id, ``parent_run_id`` set, events in the log)."""

    async def play(parent: RunHandle, args: dict[str, Any]) -> Any:
        return await parent.start_child(parent, spec.name, args)  # type: ignore[misc]

    return workflow_tool(spec.name, spec.source.graph, None, play)
