"""kit_cli: the ``kit`` console script (argparse), a thin reader and writer of the event store.

Owns: argv parsing, finding the event log (``--store``, else ``KIT_STORE``, else the log of the
project at ``KIT_PROJECT`` or ``.kit``, as ``kit-serve`` finds it) and printing what it reads.
Must never: start or render a conversation (SPEC 1: it prints log events, never a reply); print
the application context or secrets (neither is in the log).

Commands:
  kit runs list [--store URL] [--status S] [--name N] [--session ID] [--namespace NS]
                [--limit N] [--before ID] [--json]
      A page of the run index: the ``--limit`` (default ``LIST_LIMIT``) most recent runs that
      match (``--namespace``: that namespace's; a session id is per namespace, so with
      ``--session`` one conversation), started before run ``--before`` if given, oldest
      first: a header, then one line per run (run id, status, name, namespace, session, start);
      ``--json``: one JSON object per run instead.
      When older runs match, stderr says so with the command that lists the next page.
  kit runs events <run_id> [--store URL] [--after SEQ] [--follow]
      The run's events in seq order, one JSON envelope per line, those after seq ``--after``
      only if given (the last a broken ``--follow`` printed: exit 1 if the run has no such event
      yet); ``--follow`` then waits for the rest, live, until the run ends or parks, or its lease
      lapses (exit 1: no process plays it; checked every ``LEASE_CHECK`` seconds).
  kit runs signal <run_id> {pause,cancel,resume} [--store URL] [--reason TEXT]
      Records the request for a run another process plays; that process acts on it at the run's
      next safe point (a resume is taken up by a deck that has the run's agent or workflow).

Values from the log reach a terminal as text: a table cell, a hint or an error shows each
character Python's ``repr`` would escape (control characters, line separators, bidi overrides)
as ``repr`` escapes it, so one run is one line and a value an HTTP client wrote is never a
terminal control sequence; JSON lines escape them already (``json.dumps``, ASCII).

Every command reads the log through a read-only store (``store_from_url(..., read_only=True)``),
so it works where it may only read (a read-only mount, a file or Postgres schema of the service's
own user, a role that may only ``SELECT``), and never creates or upgrades a log: a SQLite file or
a Postgres schema that is not kit's log (no ``events`` table, not a database, no such schema) is
refused, naming it, and left as it is. Only ``signal`` then writes, its one request, through a
store it opens once the read-only one found the run.

argparse checks every argument: text is UTF-8 (a non-UTF-8 byte in argv is a usage error naming
the argument), ``--limit`` is 1 to ``LIST_LIMIT_MAX``, ``--after`` a seq, a run id, ``--name``,
``--session``, ``--namespace``, ``--store`` and ``--before`` are not empty.

Output that meets a closed pipe (``kit runs list | head``) ends quietly. Exit codes: 0 done (or
recorded), 1 an unknown run (or event: ``--after``), a request that cannot act on the run (a
finished run; pause of a parked run; resume of a run that is not paused: the message says its
status) or a log that cannot be read (the message names it), 2 a usage error (clig.dev
conventions), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sqlite3
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone

import anyio

from kit_core import (ConfigError, EventStorePort, RunInfo, RunStatus, UnknownRunError,
                      control_refusal, printable)
from kit_pg import store_from_url
from kit_store import project_log_url, read_only_log
from kit_storebase import masked, replay

__all__ = ("main", "LIST_LIMIT", "LIST_LIMIT_MAX")

#: Runs per page of ``kit runs list``: a screenful of the newest; older pages are one
#: ``--before`` away, each read as one index range however long the log.
LIST_LIMIT = 50
#: The largest ``--limit``: a page is read whole before it prints, so it is held in memory at
#: once (and SQLite's and Postgres's LIMIT are 64-bit); more runs are ``--before`` pages away.
LIST_LIMIT_MAX = 100_000
#: How often ``runs events --follow`` asks whether a process still holds the run's lease.
LEASE_CHECK = 5.0

_STORE_HELP = ("event store URL, e.g. sqlite:///app.db (default: $KIT_STORE, else the project's "
               "log, $KIT_PROJECT/.state/kit.db with KIT_PROJECT defaulting to .kit)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kit", description="Inspect kit's event log.")
    commands = p.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="runs in the event log").add_subparsers(
        dest="action", required=True)
    ls = runs.add_parser("list", help="list the most recent runs, oldest first")
    ls.add_argument("--status", choices=[s.value for s in RunStatus])
    ls.add_argument("--name", type=_nonempty, help="only runs of this agent or workflow")
    ls.add_argument("--session", type=_nonempty, help="only runs of this session id")
    ls.add_argument("--namespace", type=_nonempty,
                    help="only runs of this namespace (a session id is per namespace)")
    ls.add_argument("--limit", type=_positive, default=LIST_LIMIT,
                    help=f"at most this many runs, the most recent (default {LIST_LIMIT}, "
                         f"at most {LIST_LIMIT_MAX})")
    ls.add_argument("--before", metavar="RUN_ID", type=_nonempty,
                    help="only runs started before this one (the first run of the previous page)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    events = runs.add_parser("events", help="print a run's events as JSON lines")
    events.add_argument("run_id", type=_nonempty)
    events.add_argument("--follow", action="store_true",
                        help="then wait for the rest, live, until the run ends or parks")
    events.add_argument("--after", metavar="SEQ", type=_seq, default=-1,
                        help="only the events after this seq (the last one printed before)")
    sig = runs.add_parser("signal", help="ask a run to pause, cancel or resume")
    sig.add_argument("run_id", type=_nonempty)
    sig.add_argument("signal", choices=["pause", "cancel", "resume"])
    sig.add_argument("--reason", type=_text, help="recorded with the request")
    for command in (ls, events, sig):
        command.add_argument("--store", type=_store_url, help=_STORE_HELP)
    return p


def _text(text: str) -> str:
    """An argument as text the log can hold: argv bytes that are not UTF-8 arrive as lone
    surrogates (PEP 383), which no store can encode, so they are a usage error naming it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"must be UTF-8 text, got {text!r}") from None
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= LIST_LIMIT_MAX:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer at most {LIST_LIMIT_MAX}, got {text!r}")
    return value


def _seq(text: str) -> int:
    """An event's seq, as ``--after`` takes it (-1: before the first)."""
    if not (text == "-1" or (text.isascii() and text.isdigit() and len(text) <= 18)):
        raise argparse.ArgumentTypeError(f"must be an event seq (0, 1, ...; -1: from the start), "
                                         f"got {text!r}")
    return int(text)


def _nonempty(text: str) -> str:
    """A run id, a name or a session id: ``_text`` that is not empty (no id or name is; an
    empty one is a shell variable that was not set, never a lookup that finds nothing)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return _text(text)


def _store_url(text: str) -> str:
    if not text:  # not "unset": an empty --store would silently read another log
        raise argparse.ArgumentTypeError("must be a store URL, got ''")
    return _text(text)


class _Refused(Exception):
    """The request cannot act on the run in its state (exit 1)."""


async def _signal(store: EventStorePort, a: argparse.Namespace) -> None:
    async with store:  # type: ignore[attr-defined]
        info = await store.run_info(a.run_id)
    if info is None:
        raise UnknownRunError(a.run_id)
    refusal = control_refusal(a.signal, info.status)
    if refusal is not None:
        raise _Refused(f"run {a.run_id}: {refusal}")
    async with store_from_url(store.url) as log:  # type: ignore[attr-defined]
        request_id = await log.request(a.run_id, a.signal, a.reason, "cli")
    print(f"{a.signal} requested for run {printable(a.run_id)} (request {request_id})")


async def _list(store: EventStorePort, a: argparse.Namespace) -> None:
    async with store:  # type: ignore[attr-defined]
        # One more than the page: whether older runs match, without counting them.
        infos = await store.runs(status=RunStatus(a.status) if a.status else None,
                                 name=a.name, session_id=a.session, limit=a.limit + 1,
                                 before=a.before, namespace=a.namespace)
    older = len(infos) > a.limit
    infos = infos[-a.limit:]
    _print_runs(infos, a.json)
    if older:
        sys.stdout.flush()  # the page first, then the hint after it on a terminal
        _say(f"older runs match; the next page: {_next_page(a, infos[0].run_id)}")


def _next_page(a: argparse.Namespace, before: str) -> str:
    """The ``kit runs list`` command of the page before run ``before``, with this one's options
    (a password in ``--store`` masked: it never reaches a terminal or a log)."""
    words = ["kit", "runs", "list"]
    for flag, value in (("--status", a.status), ("--name", a.name), ("--session", a.session),
                        ("--namespace", a.namespace),
                        ("--store", masked(a.store) if a.store else None)):
        if value is not None:
            words += [flag, value]
    if a.limit != LIST_LIMIT:
        words += ["--limit", str(a.limit)]
    words += ["--before", before] + (["--json"] if a.json else [])
    return shlex.join(words)


def _print_runs(infos: Sequence[RunInfo], as_json: bool) -> None:
    if as_json:
        for i in infos:
            print(json.dumps({"run_id": i.run_id, "status": i.status.value, "name": i.name,
                              "invocable": i.invocable, "session_id": i.session_id,
                              "namespace": i.namespace, "started_at": i.started_at.isoformat(),
                              "parent_run_id": i.parent_run_id}))
        return
    # The namespace beside the session: one session id under two namespaces is two
    # conversations (two tenants'), which the session column alone showed as one.
    rows = [("RUN_ID", "STATUS", "NAME", "NAMESPACE", "SESSION", "STARTED")] + [
        (printable(i.run_id), i.status.value, printable(i.name), printable(i.namespace or "-"),
         printable(i.session_id or "-"),
         i.started_at.isoformat(timespec="seconds")) for i in infos]
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5])


async def _events(store: EventStorePort, a: argparse.Namespace) -> None:
    async with store:  # type: ignore[attr-defined]
        info = await store.run_info(a.run_id)
        if info is None:
            raise UnknownRunError(a.run_id)
        if info.last_seq is not None and a.after > info.last_seq:  # never printed, so a typo
            raise _Refused(f"run {a.run_id} has no event {a.after} (its last is {info.last_seq})")
        if not a.follow:
            async for event in replay(store, a.run_id, a.after):  # a page at a time
                print(json.dumps(event.to_json(), separators=(",", ":")))
            return
        ended: list[Exception] = []  # why the tail stopped short: a store error, or no player
        async with anyio.create_task_group() as tg:
            async def tail() -> None:
                try:
                    async for event in store.follow(a.run_id, a.after):  # flushed: as it happens
                        print(json.dumps(event.to_json(), separators=(",", ":")), flush=True)
                except Exception as exc:
                    ended.append(exc)
                tg.cancel_scope.cancel()

            async def watch() -> None:  # a run whose process died never ends by itself
                while not ended:
                    await anyio.sleep(LEASE_CHECK)
                    try:
                        until = await store.lease_until(a.run_id)
                    except Exception as exc:
                        ended.append(exc)
                    else:
                        if until is not None and until < time.time():  # (None: parked, ended)
                            ended.append(_Refused(_lapsed(a.run_id, until)))
                tg.cancel_scope.cancel()

            tg.start_soon(tail)
            tg.start_soon(watch)
        if ended:
            raise ended[0]


def _lapsed(run_id: str, until: float) -> str:
    since = datetime.fromtimestamp(until, timezone.utc).isoformat(timespec="seconds")
    return (f"run {run_id} has had no process playing it since {since}: its lease lapsed (the "
            "process died, or lost the store); the next deck that opens on this log records "
            "it as abandoned")


class _Unreadable(Exception):
    """The log named cannot be read: a SQLite file that is not there, not a database, or a
    database that is not kit's log (exit 1; the message names the file)."""


def _store(a: argparse.Namespace) -> tuple[EventStorePort, str]:
    """The read-only store of the log (see the module docstring), unopened, and where it is for
    an error (the SQLite path, or the URL with its password masked). Raises ``ConfigError`` for
    one the command cannot read (a malformed URL, the in-memory store) and ``_Unreadable`` for a
    SQLite file that is not there or is not kit's log."""
    env = os.environ
    if a.store:
        url, source = a.store, "--store"
    elif env.get("KIT_STORE", "").strip():  # exported but empty: unset, as a deck reads it
        url, source = env["KIT_STORE"].strip(), "KIT_STORE"
    else:
        project = env.get("KIT_PROJECT") or ".kit"  # empty: unset, as kit-serve reads it
        url, source = project_log_url(project), f"the project {project} (KIT_PROJECT)"
    store = store_from_url(url, read_only=True, setting=source)  # a malformed URL: say whose
    if url == "memory":
        raise ConfigError(f"{source} names the in-memory store, whose log lives and dies with its "
                          "process: pass --store sqlite:///path/to/kit.db")
    if not url.startswith("sqlite:///"):
        return store, masked(url)
    path = url[len("sqlite:///"):]
    if not os.path.exists(path):
        raise _Unreadable(f"no event log at {path} (from {source}); pass "
                          "--store sqlite:///path/to/kit.db, or set KIT_STORE or KIT_PROJECT")
    _check_kit_log(path, source)
    return store, path


def _check_kit_log(path: str, source: str) -> None:
    """Raise ``_Unreadable`` naming ``path`` and ``source`` unless it is a SQLite database with
    kit's ``events`` table (``read_only_log``'s look, before the store's own)."""
    try:
        read_only_log(path).close()
    except sqlite3.Error as exc:  # not a database, a directory, unreadable
        raise _Unreadable(f"cannot read {path} (from {source}) as a kit event log: "
                          f"{type(exc).__name__}: {exc}") from None
    except ConfigError:
        raise _Unreadable(f"{path} (from {source}) is not a kit event log (it has no events "
                          "table); it is left as it is: pass --store sqlite:///path/to/kit.db"
                          ) from None


def _say(message: str) -> None:
    """``message`` on stderr as ``kit: ...``, one line, its control characters escaped (it may
    quote the log)."""
    print(f"kit: {printable(message)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kit`` command; returns the exit code."""
    a = _parser().parse_args(argv)
    try:
        store, where = _store(a)
    except ConfigError as exc:
        _say(str(exc))
        return 2
    except _Unreadable as exc:
        _say(str(exc))
        return 1
    command = {"list": _list, "events": _events, "signal": _signal}[a.action]
    try:
        anyio.run(command, store, a)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`kit runs list | head`): stop quietly. Later writes, and the final
        # flush at exit, go to devnull instead of raising again (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except (UnknownRunError, _Refused) as exc:
        _say(str(exc))
        return 1
    except ConfigError as exc:  # not kit's log (a Postgres schema without it), or a newer one
        _say(f"{where}: {exc}")
        return 1
    except Exception as exc:  # the store could not be read (or written): say which and why
        _say(f"{where}: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
