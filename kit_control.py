"""kit_control: run control and parked runs, the Runtime's second half.

Owns: control requests (pause, cancel, resume: recorded, acted on here, followed from other
processes), the fence around a write that races other writers of a run (``_fence``: a caller's
run id, a take-over, a parked run's cancel), taking over a paused run, a parked run's cancel,
parked workflows (answer, pending, due, tick, the orphan scan), and the deck's background loops
(``_every``: lease renewal and reaping, the control watch); ``RunControl``, a mixin only
``kit_runtime.Runtime`` uses.

Must never: write to the store but through the Runtime's write path (``_write``, ``_take_over``
here, the run's own ``_play``); speak HTTP or read argv; print, log or persist the application
context.

Theory of operation
-------------------
A parked run (paused, waiting for a human, sleeping) has no writer. Whoever goes on with it
becomes its writer by appending its next events fenced by seq (``_take_over``): of two callers or
processes racing, the store's unique ``(run_id, seq)`` lets one write, and the other hears it was
resumed by someone else. Requests written elsewhere reach this deck through ``_watch_requests``
(the store's ``follow_requests``); one the store fails is met again when the watch starts over,
``ACT_TRIES`` times at most. The live runs' leases are renewed every third of a lease, and the
runs whose owner stopped renewing are reaped (recorded abandoned) on the same beat. ``RunControl``
uses the Runtime's state and write path; it holds only the bookkeeping of the fence, the reaper
and the watch (``_init_control``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio

import kit_threads
import kit_workflows
from kit_core import (
    CheckpointMissingError, ControlRequest, ControlRequested, DeckStateError, Due, Event,
    LogConflictError, ModelCompleted, Pending, RunCancelled, RunInfo, RunInterrupted,
    RunNotWaitingError, RunResumed, RunSleeping, RunStatus, SessionBusyError,
    StoreUnavailableError, Ticked, UnknownNameError, UnknownRunError, check_id, check_text, stops,
)
from kit_storebase import replay

if TYPE_CHECKING:
    from kit_runs import Run

__all__ = ("RunControl", "BACKOFF_MAX", "ACT_TRIES", "ORPHAN_SCAN")

#: A background loop (lease renewal, the control watcher) that fails backs off up to this long
#: between tries (seconds), logging once per burst; it never takes the deck down.
BACKOFF_MAX = 30.0
#: How many times in a row the deck tries to act on one control request recorded elsewhere (a
#: parked run's cancel, a resume) while the store fails: with the backoff above, half a minute
#: of a store gone for a moment is ridden out; then the request is logged and passed over, so
#: one that can never be acted on does not hold up the ones after it.
ACT_TRIES = 5
#: How often (seconds) ``tick`` scans the checkpointers whole for threads asleep that no run of
#: the log parks (a process died between a sleep's checkpoint and its ``run.sleeping``); every
#: other tick reads only the sleeping runs' threads, whatever the checkpointers' history.
ORPHAN_SCAN = 600.0
_PARKED = (RunStatus.PAUSED, RunStatus.WAITING_HUMAN, RunStatus.SLEEPING)
_SKIPPED = object()  # a due thread another ticker has
_log = logging.getLogger("kit.runtime")


class _Cancel:
    """A parked run's cancel being written by this deck (``RunControl._fence``): a second cancel
    meanwhile (the store down, the first retrying) waits for the first's outcome and has it."""

    def __init__(self) -> None:
        self.started, self.done = False, anyio.Event()
        self.error: BaseException | None = None

    async def outcome(self) -> None:
        await self.done.wait()
        if self.error is not None:  # (a first one cancelled: the deck is closing)
            raise self.error if isinstance(self.error, Exception) else DeckStateError(
                "CLOSED", "cancel the run")


class RunControl:
    """The Runtime's run control and parked runs: a mixin of ``kit_runtime.Runtime``, whose
    state it reads (``specs``, ``store``, ``writer``, ``active``, ``graphs``, ``sessions``,
    ``owner``, ``lease``) and whose write path it writes through (``_new_run``, ``_begin``,
    ``_start_run``, ``_write``, ``_committed``, ``_play``, ``_finish``, ``_streamed``,
    ``_on_engine``)."""

    def _init_control(self) -> None:
        # Run ids a fenced write is in flight for (``_fence``) -> the run it starts or takes
        # over (None for a parked run's cancel): a request meanwhile is that run's.
        self._fenced: dict[str, Run | None] = {}
        self._cancels: dict[str, _Cancel] = {}  # parked runs whose cancel is written here
        self._reaped: set[str] = set()  # reaped runs whose end the observers are still owed
        self._seen_request = 0  # the newest control request this deck has acted on
        self._handled: set[int] = set()  # requests made here, acted on already, not met yet
        self._failing = (0, 0)  # (request id, failed tries) of a request the store failed
        self._orphans: dict[str, str] = {}  # sleeping thread keys no log run parks -> workflow
        self._orphans_at = 0.0  # when tick next scans the checkpointers for them

    # --------------------------------------------------------------- background loops --
    async def _every(self, seconds: float, step: Callable[[], Any], what: str,
                     most: float = BACKOFF_MAX) -> None:
        """Call ``step`` every ``seconds``, forever. A failing step (a store that is down or
        locked) is logged once per burst and retried with backoff, up to ``most`` apart; it
        never ends the loop, and never the deck. A step that runs for good (the control watch)
        and fails after working for longer than it last waited starts a new burst: its backoff
        does not ratchet up to ``most`` over a process's life."""
        delay = seconds
        while True:
            await anyio.sleep(delay)
            started = anyio.current_time()
            try:
                await step()
            except Exception as exc:
                if anyio.current_time() - started > delay:  # it had been working again
                    delay = seconds
                if delay == seconds:
                    _log.warning("%s failed (%s: %s); retrying with backoff", what,
                                 type(exc).__name__, exc)
                delay = min(max(delay * 2, 1.0), most)
            else:
                if delay != seconds:
                    _log.warning("%s works again", what)
                delay = seconds

    async def _keep_leases(self) -> None:
        """Renew the leases of the runs still played here (or with events still to commit),
        and only those; reap runs whose owner stopped renewing; let go of conversations held
        for runs paused here that went on elsewhere (``_let_go``)."""
        started = anyio.current_time()
        if started - self._renewed > self.lease:  # stalled past it: reaped elsewhere? (_flushed)
            self._doubted = set(self.active)
        live = set(self.active) | self.writer.pending_runs()
        await self.store.renew(self.owner, self.lease, sorted(live))
        self._renewed = started
        await self._reap()
        await self._let_go()

    async def _let_go(self) -> None:
        """Let go of the conversations held for runs paused here that the store shows moved
        on (resumed or cancelled elsewhere: their end is never seen here), so they count toward
        ``KIT_SESSION_MAX`` again: one run-index lookup each, a failing store asked next time."""
        for run_id in self.sessions.holding() if self.sessions is not None else ():
            if not self._playing(run_id):
                with contextlib.suppress(Exception):
                    info = await self.store.run_info(run_id)
                    if (info is None or info.status is not RunStatus.PAUSED) and not (
                            self._playing(run_id)):  # (taken over here meanwhile)
                        self.sessions.release(run_id)  # type: ignore[union-attr]

    async def _reap(self) -> None:
        """Record the runs whose owner stopped renewing as abandoned (the store writes their
        ``run.failed`` in the transaction that frees their claims); the observers get it too,
        all in one read (``last_events``), at the next round if it fails (no reap repeats one)."""
        self._reaped.update(await self.store.reap())
        if reaped := sorted(self._reaped):
            ends = await self.store.last_events(reaped)
            self._reaped.difference_update(reaped)
            self._committed([ends[run_id] for run_id in reaped if run_id in ends])

    # -------------------------------------------------------------------- run control --
    async def request(self, run_id: str, action: str, reason: str | None, source: str) -> None:
        """Record a pause/cancel request and return: a run played here is told at once (from
        the moment its id exists, child runs included), one played elsewhere sees it through its
        process's poll; a parked run is cancelled here."""
        check_id("run_id", run_id)
        check_text("reason", reason)
        run = self._playing(run_id)
        if run is not None:
            run.request(action, reason, source)
            with anyio.move_on_after(self.down_limit):  # (not for as long as the store is down)
                await self.writer.flush()  # its start may wait in the buffer: the store must know it
        request_id = await self.store.request(run_id, action, reason, source)
        if request_id > self._seen_request:  # else the watch met it already: it never comes again
            self._handled.add(request_id)
        if run is None:
            await self._act(ControlRequest(request_id, run_id, action, reason, source))

    def _playing(self, run_id: str) -> Run | None:
        """The run played here under ``run_id``, or being started or taken over here (its first
        events committing): a request reaches it at its first safe point. Without the latter, a
        cancel meeting a resume's take-over found the run neither playing nor parked, and was
        dropped."""
        return self.active.get(run_id) or self._fenced.get(run_id)

    async def _act(self, req: ControlRequest) -> None:
        run = self._playing(req.run_id)
        if run is not None:
            if req.action != "resume":
                run.request(req.action, req.reason, req.source)
        elif req.action == "cancel":
            await self._cancel_parked(req)

    async def _cancel_parked(self, req: ControlRequest) -> None:
        """Cancel a parked run (``_cancel_now``) in the deck's task group: while the store takes
        no writes its caller gets ``StoreUnavailableError`` after the bound, and the cancel is
        written (its thread let go) once the store is back; until then its fence keeps a second
        cancel from writing it again (their one commit would refuse both)."""
        done, failed, gone = anyio.Event(), [], anyio.move_on_after(self.down_limit)

        async def cancel() -> None:
            try:
                await self._cancel_now(req)
            except Exception as exc:  # its caller's; logged once no caller waits for it
                failed.append(exc)
                if gone.cancel_called:
                    _log.error("the cancel of run %s, written after its caller gave up, failed: "
                               "%s: %s", req.run_id, type(exc).__name__, exc)
            finally:
                done.set()
        self._tg.start_soon(cancel)
        with gone:
            await done.wait()
        if failed:
            raise failed[0]
        if not done.is_set():
            raise StoreUnavailableError(req.run_id, self.down_limit)

    async def _cancel_now(self, req: ControlRequest) -> None:
        """A parked run has no writer: whoever handles its cancel becomes it (DESIGN 6); of two
        processes racing, the unique ``(run_id, seq)`` lets one write. A workflow's thread goes
        with it, in every deck that sees the cancel (a non-durable one's checkpoints live in the
        memory of the deck that parked it, which may not be the one that wrote the cancel)."""
        info = await self.store.run_info(req.run_id)
        if info is None or info.status not in (*_PARKED, RunStatus.CANCELLED):
            return
        if info.status is not RunStatus.CANCELLED:
            last = await self._last_event(info)
            if last.payload.ends != "parking":  # resumed since: its player hears the request
                return self._reach(req)
            try:
                with self._fence(req.run_id, last.seq + 1):
                    await self._write(None, [
                        Event(req.run_id, last.seq + 1,
                              ControlRequested("cancel", req.reason, req.source), last.origin),
                        Event(req.run_id, last.seq + 2, RunCancelled(req.reason), last.origin)])
            except LogConflictError:  # another caller got there first: a cancel, or a resume
                info = await self.store.run_info(req.run_id)
                if info is None or info.status is not RunStatus.CANCELLED:
                    # resumed: its thread is in use (a cancel elsewhere: forget ours too)
                    return self._reach(req)
        if self.sessions is not None:  # (cancelled by another deck: no run.cancelled put here)
            self.sessions.release(req.run_id)
        spec = self.specs.get(info.name)
        if spec is None or spec.kind != "workflow":
            return
        key = spec.engine.key(info.namespace, info.session_id or req.run_id)  # _new_run's
        if info.session_id is not None and (  # the session's thread: only if no run took it since
                await self.store.session_holder(info.session_id, info.namespace) is not None
                or any(run.thread_key == key for run in self.active.values())):
            return
        await self._on_engine(spec.engine.forget, self.graphs[spec.name], key,
                              info.session_id is None)

    def _reach(self, req: ControlRequest) -> None:
        """A parked run's ``req`` met a resume or an answer that took the run over: a run taken
        over here is told now (the watch passes over a request made here); one taken over in
        another process hears it through that process's watch."""
        run = self._playing(req.run_id)
        if run is not None:
            run.request(req.action, req.reason, req.source)

    @contextlib.contextmanager
    def _fence(self, run_id: str, seq: int, run: Run | None = None) -> Iterator[None]:
        """Around a fenced write (a caller's run id, a take-over, a parked run's cancel): one
        per run id at a time in this deck, and none for a run played here. A second caller
        racing for the id is refused (``LogConflictError``) before it writes anything, as the
        store refuses one from another process: in one group commit the store would refuse
        both writes, and the first caller would play on without its first event. A parked
        run's second cancel while the first is written here (``run`` None) is let in: its
        ``_write`` writes nothing and has the first one's outcome (``_Cancel``)."""
        if run is None and run_id in self._cancels:
            yield
            return
        if run_id in self._fenced or run_id in self.active:
            raise LogConflictError(run_id, seq)
        self._fenced[run_id] = run
        if run is None:
            self._cancels[run_id] = _Cancel()
        try:
            yield
        finally:
            del self._fenced[run_id]
            self._cancels.pop(run_id, None)

    async def _take_over(self, run: Run, events: Sequence[Event]) -> None:
        """Become the writer of a parked run: append ``events`` (the resume) with its claim,
        fenced by seq (``LogConflictError`` when another caller got there first), as a fenced
        start is written (``_start_run``): a caller cancelled meanwhile leaves it cancelled, not
        resumed; while the store takes no writes, ``StoreUnavailableError`` after the bound
        (``"not started"``: the run stays parked; else it is recorded failed)."""
        run.seq = events[-1].seq
        try:
            await self._start_run(run, events, True)
        except BaseException:
            self._unstream(run)
            raise

    async def _take_paused(self, run_id: str, context: Any, streaming: bool,
                           req: ControlRequest | None = None
                           ) -> tuple[Run, Callable[[], Any], int] | None:
        """Become the writer of a paused run: the run, its job and the seq it paused at, or None
        when there is nothing to resume here (unknown, not paused, playing, another caller
        resumed it first, or this deck lacks its invocable: SPEC 3.2). ``req``: the resume
        request from the store (the CLI's, another replica's) whose reason and source the log
        records; without it, the API's."""
        info = await self.store.run_info(run_id)
        spec = self.specs.get(info.name) if info is not None else None
        if info is None or spec is None or info.status is not RunStatus.PAUSED or run_id in self.active:
            return None
        paused = await self._last_event(info)
        if paused.kind != "run.paused":  # resumed since the index was read: not ours to take
            return None
        used: list[Any] = [0, 0, 0.0]  # its usage so far (run.completed totals the whole run),
        async for event in replay(self.store, run_id):  # ... read a page at a time
            if isinstance(p := event.payload, ModelCompleted) and event.seq < paused.seq:
                used = [used[0] + p.input_tokens, used[1] + p.output_tokens,
                        None if p.usd is None or used[2] is None else used[2] + p.usd]
        session = None
        if spec.kind == "agent" and info.session_id is not None:
            # Made first, as a turn's is (_begin): a factory that fails (its backend down) leaves
            # the run paused, not taken over and then played by nobody.
            session = self.sessions.peek(info.session_id, info.namespace)  # type: ignore[union-attr]
        asked = (ControlRequested("resume", req.reason, req.source) if req is not None
                 else ControlRequested("resume", None, "api"))
        try:
            run = self._new_run(spec, run_id, context, info.session_id, info.namespace, streaming)
            run.origin = paused.origin  # a child run's is its parent's path (``agent/workflow``)
            run.add_usage(*used)
            if spec.kind == "workflow":
                await self._check_thread(run)
            await self._take_over(run, [
                Event(run_id, paused.seq + 1, asked, run.origin),
                Event(run_id, paused.seq + 2, RunResumed("resume"), run.origin)])
        except BaseException as exc:
            if session is not None:
                self.sessions.unpeek(info.session_id, info.namespace)  # type: ignore[union-attr, arg-type]
            if isinstance(exc, LogConflictError):
                return None  # another caller resumed it first
            raise
        if spec.kind == "agent":
            if session is not None:  # taken over: never evicted until its end
                self.sessions.hold(run_id, info.session_id, info.namespace, session)  # type: ignore[union-attr, arg-type]
            items = [] if session is not None else (paused.payload.items or [])
            job = functools.partial(spec.engine.play, run, items, session,
                                    self._agents.run_config(self._sdk_tracing, run_id, info.session_id))
        else:
            job = functools.partial(spec.engine.play, run, self.graphs[spec.name], None)
        return run, job, paused.seq

    async def resume(self, run_id: str, context: Any) -> list[Event]:
        check_id("run_id", run_id)
        taken = await self._take_paused(run_id, context, False)
        if taken is None:
            return []
        run, job, after = taken
        await self._play(run, job)
        return await self.store.read(run_id, after=after)

    def stream_resume(self, run_id: str, context: Any, committed: bool = False) -> AsyncIterator[Event]:
        async def take() -> tuple[Run, Callable[[], Any], int] | None:
            check_id("run_id", run_id)
            return await self._take_paused(run_id, context, True)
        return self._streamed(take, committed)

    async def _watch_requests(self) -> None:
        """Requests written by other processes (the CLI, replicas), as the store hears of them
        (``follow_requests``: NOTIFY on Postgres; SQLite's poll): pause/cancel reach the runs
        played here; a resume is taken up by any deck that has the run's invocable (the first
        to write wins); a parked run's cancel is written by whichever deck sees it first. A
        request is seen once it is acted on: one the store fails (``_act_or_raise``) is met
        again when the watch starts over."""
        requests = self.store.follow_requests(after=self._seen_request)
        async with contextlib.aclosing(requests):
            async for req in requests:
                if req.id in self._handled:
                    pass  # made here: acted on then
                elif req.action == "resume" and req.run_id not in self.active:
                    self._tg.start_soon(self._resume_quietly, req)
                else:
                    await self._act_or_raise(req)
                self._seen_request = req.id
                if self._handled:  # met in id order: none at or below it comes again
                    self._handled = {i for i in self._handled if i > req.id}

    async def _missed_requests(self, seen: int) -> None:
        """At open: the requests up to ``seen`` made while no deck was open to hear them (``kit
        runs signal`` against a stopped service) are orders still, not history. A cancel of a
        run still parked was never acted on (it would have ended the run); a resume of a run
        still paused is, when no pause followed it. Acted on as the watch acts (the first deck
        to write wins); the watch has those after ``seen``. Only the parked runs' requests are
        read: every request the log ever took cost an open 0.48 s at 200,000."""
        try:
            parked = {info.run_id: info.status for status in _PARKED
                      for info in await self.store.runs(status=status)}
            backlog = await self.store.requests(run_ids=list(parked)) if parked else []
        except Exception as exc:  # the store failed: they wait for the next open
            _log.error("reading the parked runs at open failed: %s: %s", type(exc).__name__, exc)
            return
        last: dict[str, ControlRequest] = {}
        for req in backlog:  # per parked run: its first cancel, else its last request
            if req.id <= seen and getattr(last.get(req.run_id), "action", "") != "cancel":
                last[req.run_id] = req
        for req in last.values():
            if req.action == "cancel":
                try:
                    await self._act(req)
                except Exception as exc:  # the store failed: logged, the run stays parked
                    _log.error("control request %d (cancel of run %s) made while no deck was "
                               "open failed: %s: %s", req.id, req.run_id, type(exc).__name__, exc)
            elif req.action == "resume" and parked[req.run_id] is RunStatus.PAUSED:
                self._tg.start_soon(self._resume_quietly, req)

    async def _act_or_raise(self, req: ControlRequest) -> None:
        """``_act``; a failure is raised (``_every`` starts the watch over after its backoff),
        up to ``ACT_TRIES`` times in a row for one request, then logged and passed over."""
        try:
            await self._act(req)
        except Exception as exc:
            failing, tries = self._failing
            tries = tries + 1 if failing == req.id else 1
            self._failing = (req.id, tries)
            if tries < ACT_TRIES:
                raise
            _log.error("control request %d (%s of run %s) passed over after %d tries: %s: %s",
                       req.id, req.action, req.run_id, tries, type(exc).__name__, exc)

    async def _resume_quietly(self, req: ControlRequest) -> None:
        """A resume request from the log (its run id, as old as the log, is not re-checked).
        Taking the run over is tried ``ACT_TRIES`` times while the store fails; the run's own
        failure is in its log (``run.failed``), with nobody here to tell."""
        run_id = req.run_id
        for tries in range(1, ACT_TRIES + 1):
            try:
                taken = await self._take_paused(run_id, None, False, req)
                break
            except CheckpointMissingError:
                return  # a non-durable workflow's run: the process that parked it takes it up
            except Exception as exc:
                if tries == ACT_TRIES:
                    _log.error("resuming run %s passed over after %d tries: %s: %s", run_id,
                               tries, type(exc).__name__, exc)
                    return
                await anyio.sleep(min(2.0 ** tries, BACKOFF_MAX))
        if taken is not None:
            with contextlib.suppress(Exception):
                await self._play(taken[0], taken[1])

    # --------------------------------------------------------------- parked workflows --
    async def _unpark(self, run_id: str, wanted: str, value: Any, by: str, context: Any,
                      streaming: bool = False) -> tuple[Run, Callable[[], Any], int]:
        """Become the writer of a parked workflow run (``wanted``: the parking kind it must end
        with): the run, the job that resumes it with ``value`` and the seq it parked at."""
        status = {"run.interrupted": "WAITING_HUMAN", "run.sleeping": "SLEEPING"}[wanted]
        info = await self.store.run_info(run_id)
        if info is None:
            raise UnknownRunError(run_id)
        last = await self._last_event(info)
        if last.kind != wanted or run_id in self.active:
            raise RunNotWaitingError(run_id, info.status, status)
        spec = self.specs.get(info.name)
        if spec is None or spec.kind != "workflow":
            raise UnknownNameError(info.name, [n for n, s in self.specs.items() if s.kind == "workflow"])
        if wanted == "run.interrupted":  # an answer: refused now, not by the run's checkpoint
            spec.engine.check_answer(value)
        parked = last.payload
        run = self._new_run(spec, run_id, context, info.session_id, info.namespace, streaming)
        run.origin = last.origin  # a child run's is its parent's path (``agent/workflow``)
        run.thread_id = parked.thread_id
        run.thread_key = spec.engine.key(info.namespace, parked.thread_id)
        await self._check_thread(run)
        try:  # (run_id, seq) is unique: of two callers racing to resume, one gets this conflict
            await self._take_over(run, [Event(run_id, last.seq + 1, RunResumed(by), run.origin)])
        except LogConflictError:
            raise RunNotWaitingError(run_id, "being resumed by another caller", status) from None
        command = kit_workflows.resume_command(parked.interrupt_id, value)
        return run, functools.partial(spec.engine.play, run, self.graphs[spec.name], command), last.seq

    async def _check_thread(self, run: Run) -> None:
        """Raise ``CheckpointMissingError`` (the run stays parked) unless this deck's
        checkpointer holds the thread that parked workflow ``run`` goes on from: without it,
        LangGraph would start the graph over with an empty state and the answer would be lost."""
        spec = run.spec
        graph = self.graphs[spec.name]
        if not await self._on_engine(kit_threads.holds_thread, graph, run.thread_key):
            self._unstream(run)
            raise CheckpointMissingError(run.run_id, spec.name, spec.engine.durable)

    async def _resume(self, run_id: str, wanted: str, value: Any, by: str, context: Any) -> Any:
        run, job, _ = await self._unpark(run_id, wanted, value, by, context)
        return await self._finish(run, job)

    async def answer(self, run_id: str, value: Any, context: Any) -> Any:
        check_id("run_id", run_id)
        return await self._resume(run_id, "run.interrupted", value, "answer", context)

    def stream_answer(self, run_id: str, value: Any, context: Any,
                      committed: bool = False) -> AsyncIterator[Event]:
        async def take() -> tuple[Run, Callable[[], Any], int]:
            check_id("run_id", run_id)
            return await self._unpark(run_id, "run.interrupted", value, "answer", context, True)
        return self._streamed(take, committed)

    async def _last_event(self, info: RunInfo) -> Event:
        """The last event of ``info``'s run as the log holds it now: the rows from the index's
        ``last_seq`` on (one, unless the run moved on since), not the whole log (that, from a
        store whose index does not keep ``last_seq``)."""
        after = -1 if info.last_seq is None else info.last_seq - 1
        return (await self.store.read(info.run_id, after))[-1]

    async def pending(self) -> list[Pending]:
        out = []
        waiting = await self.store.runs(status=RunStatus.WAITING_HUMAN)
        # Their questions in one read (``last_events``), not one each: a round trip per run on
        # Postgres (5,000 waiting runs: 0.5-3.4 s, measured; ~25 ms in one read).
        ends = await self.store.last_events([info.run_id for info in waiting])
        for info in waiting:
            last = ends.get(info.run_id)
            if last is not None and isinstance(last.payload, RunInterrupted):
                out.append(Pending(info.run_id, info.name, last.payload.thread_id or "",
                                   info.session_id, last.payload.payload, last.at,
                                   info.namespace))
        return out

    async def _due(self, now: datetime) -> list[tuple[Due, str, str | None]]:
        """Due threads, the longest overdue first, with the interrupt to wake and their
        namespace: each sleeping run of the log, checked on its thread's latest checkpoint, and
        the threads asleep that no run parks (``_orphans``), which the checkpointers are scanned
        whole for every ``ORPHAN_SCAN`` seconds (the scan reads every checkpoint of every
        thread ever played: seconds, once there are thousands)."""
        out: list[tuple[Due, str, str | None]] = []
        parked: set[str] = set()
        asleep = [info for info in await self.store.runs(status=RunStatus.SLEEPING)
                  if getattr(self.specs.get(info.name), "kind", None) == "workflow"]
        ends = await self.store.last_events([info.run_id for info in asleep])  # (as pending)
        for info in asleep:
            spec = self.specs[info.name]
            last = ends.get(info.run_id)
            if last is None or not isinstance(last.payload, RunSleeping):
                continue
            thread = last.payload.thread_id or ""
            key = spec.engine.key(info.namespace, thread)
            parked.add(key)
            found = await self._on_engine(kit_workflows.sleeping_until, self.graphs[spec.name], key)
            if found is not None and found[0] <= now:
                out.append((Due(info.name, thread, found[0], info.run_id), found[1], info.namespace))
        if anyio.current_time() >= self._orphans_at:
            self._orphans_at = anyio.current_time() + ORPHAN_SCAN
            self._orphans = dict(await self._on_engine(kit_workflows.sleeping_threads, self.graphs))
        for key, name in list(self._orphans.items()):
            found = None if key in parked else await self._on_engine(
                kit_workflows.sleeping_until, self.graphs[name], key)
            if found is None:  # woken, or parked by a run of the log now
                del self._orphans[key]
            elif found[0] <= now:
                _, namespace, thread = key.split(":", 2)
                out.append((Due(name, thread, found[0], None), found[1], namespace or None))
        return sorted(out, key=lambda due: due[0].until)  # the longest overdue first

    async def due_resumes(self, now: datetime) -> list[Due]:
        return [due for due, _, _ in await self._due(now)]

    async def tick(self, now: datetime) -> list[Ticked]:
        """Resume every due thread once. A thread whose parked run is in the log is resumed
        through that run (two tickers race on its next seq: one wins); one without (its run
        was never recorded) is resumed under the thread's lock (``ThreadLocks``: an advisory
        lock with Postgres) by a new run that claims the thread, once the lock holder has seen
        that the thread still waits, so a second ticker skips it, now or later. A thread whose
        run fails (its ``run.failed`` is in the log) does not hold up the others: they are all
        resumed, then the first failure is raised."""
        woke = {"woke_at": now.isoformat()}
        out, failed = [], []
        for due, interrupt_id, namespace in await self._due(now):
            try:
                if due.run_id is not None:
                    result = await self._resume(due.run_id, "run.sleeping", woke, "tick", None)
                else:
                    result = await self._tick_thread(due, interrupt_id, namespace, woke)
            except (RunNotWaitingError, SessionBusyError):
                continue  # another ticker (or a live run) has this thread
            except stops():
                raise
            except BaseException as exc:  # a user's BaseException that failed the run, too
                failed.append(exc)
                continue
            if result is not _SKIPPED:
                out.append(Ticked(due.workflow, due.thread_id, result))
        if failed:
            if len(failed) > 1:
                failed[0].add_note(f"tick: {len(failed) - 1} more due thread(s) failed too (each "
                                   "run's log has its run.failed)")
            raise failed[0]
        return out

    async def _tick_thread(self, due: Due, interrupt_id: str, namespace: str | None,
                           woke: Any) -> Any:
        """Resume a thread only the checkpointer knows, holding its lock; ``_SKIPPED`` when
        another ticker holds it or has resumed it already."""
        spec = self.specs[due.workflow]
        key = spec.engine.key(namespace, due.thread_id)
        if not await self._on_engine(self._thread_locks.acquire, key):
            return _SKIPPED
        try:
            graph = self.graphs[due.workflow]
            asleep = await self._on_engine(kit_workflows.sleeping_until, graph, key)
            if asleep is None or asleep[1] != interrupt_id:  # another ticker woke it since
                return _SKIPPED
            run, job, _ = await self._begin(spec, {}, None, due.thread_id, namespace, None, False,
                                            command=kit_workflows.resume_command(interrupt_id, woke))
            return await self._finish(run, job)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_engine(self._thread_locks.release, key)

