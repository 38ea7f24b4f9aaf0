"""kit_cli: the ``kit`` console script (argparse), a thin reader and writer of the event store.

Owns: argv parsing, finding the event log (``--store``, else ``KIT_STORE``, else the log of the
project at ``KIT_PROJECT`` or ``.kit``, as ``kit-serve`` finds it) and printing what it reads.
Must never: start or render a conversation (SPEC 1: it prints log events, never a reply); print
the application context or secrets (neither is in the log).

Commands:
  kit runs list [--store URL] [--status S] [--name N] [--session ID] [--limit N] [--before ID]
                [--json]
      A page of the run index: the ``--limit`` (default ``LIST_LIMIT``) most recent runs that
      match, started before run ``--before`` if given, oldest first: a header, then one line per
      run (run id, status, name, session, start); ``--json``: one JSON object per run instead.
      When older runs match, stderr says so with the command that lists the next page.
  kit runs events <run_id> [--store URL] [--follow]
      The run's events in seq order, one JSON envelope per line; ``--follow`` then waits for the
      rest, live, until the run ends or parks.
  kit runs signal <run_id> {pause,cancel,resume} [--store URL] [--reason TEXT]
      Records the request for a run another process plays; that process acts on it at the run's
      next safe point (a resume is taken up by a deck that has the run's agent or workflow).
Output that meets a closed pipe (``kit runs list | head``) ends quietly. Exit codes: 0 done (or
recorded), 1 an unknown run, a request that cannot act on the run (a finished run; pause of a
parked run; resume of a run that is not paused: the message says its status) or a log that
cannot be read, 2 a usage error (clig.dev conventions), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

import anyio

from kit_core import (ConfigError, EventStorePort, RunInfo, RunStatus, UnknownRunError,
                      control_refusal)
from kit_pg import masked, store_from_url
from kit_store import project_log_url

__all__ = ("main", "LIST_LIMIT")

#: Runs per page of ``kit runs list``: a screenful of the newest; older pages are one
#: ``--before`` away, each read as one index range however long the log.
LIST_LIMIT = 50

_STORE_HELP = ("event store URL, e.g. sqlite:///app.db (default: $KIT_STORE, else the project's "
               "log, $KIT_PROJECT/.state/kit.db with KIT_PROJECT defaulting to .kit)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kit", description="Inspect kit's event log.")
    commands = p.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="runs in the event log").add_subparsers(
        dest="action", required=True)
    ls = runs.add_parser("list", help="list the most recent runs, oldest first")
    ls.add_argument("--status", choices=[s.value for s in RunStatus])
    ls.add_argument("--name", help="only runs of this agent or workflow")
    ls.add_argument("--session", help="only runs of this session id")
    ls.add_argument("--limit", type=_positive, default=LIST_LIMIT,
                    help=f"at most this many runs, the most recent (default {LIST_LIMIT})")
    ls.add_argument("--before", metavar="RUN_ID", type=_nonempty,
                    help="only runs started before this one (the first run of the previous page)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    events = runs.add_parser("events", help="print a run's events as JSON lines")
    events.add_argument("run_id")
    events.add_argument("--follow", action="store_true",
                        help="then wait for the rest, live, until the run ends or parks")
    sig = runs.add_parser("signal", help="ask a run to pause, cancel or resume")
    sig.add_argument("run_id")
    sig.add_argument("signal", choices=["pause", "cancel", "resume"])
    sig.add_argument("--reason", help="recorded with the request")
    for command in (ls, events, sig):
        command.add_argument("--store", help=_STORE_HELP)
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must be a run id, got ''")
    return text


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
        request_id = await store.request(a.run_id, a.signal, a.reason, "cli")
    print(f"{a.signal} requested for run {a.run_id} (request {request_id})")


async def _list(store: EventStorePort, a: argparse.Namespace) -> None:
    async with store:  # type: ignore[attr-defined]
        # One more than the page: whether older runs match, without counting them.
        infos = await store.runs(status=RunStatus(a.status) if a.status else None,
                                 name=a.name, session_id=a.session, limit=a.limit + 1,
                                 before=a.before)
    older = len(infos) > a.limit
    infos = infos[-a.limit:]
    _print_runs(infos, a.json)
    if older:
        sys.stdout.flush()  # the page first, then the hint after it on a terminal
        print(f"kit: older runs match; the next page: {_next_page(a, infos[0].run_id)}",
              file=sys.stderr)


def _next_page(a: argparse.Namespace, before: str) -> str:
    """The ``kit runs list`` command of the page before run ``before``, with this one's options
    (a password in ``--store`` masked: it never reaches a terminal or a log)."""
    words = ["kit", "runs", "list"]
    for flag, value in (("--status", a.status), ("--name", a.name), ("--session", a.session),
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
    rows = [("RUN_ID", "STATUS", "NAME", "SESSION", "STARTED")] + [
        (i.run_id, i.status.value, i.name, i.session_id or "-",
         i.started_at.isoformat(timespec="seconds")) for i in infos]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])


async def _events(store: EventStorePort, a: argparse.Namespace) -> None:
    async with store:  # type: ignore[attr-defined]
        if await store.run_info(a.run_id) is None:
            raise UnknownRunError(a.run_id)
        if not a.follow:
            for event in await store.read(a.run_id):
                print(json.dumps(event.to_json(), separators=(",", ":")))
            return
        async for event in store.follow(a.run_id):  # flushed: a tail is read as it happens
            print(json.dumps(event.to_json(), separators=(",", ":")), flush=True)


def _store(a: argparse.Namespace) -> EventStorePort:
    """The store of the log (see the module docstring), unopened. Raises ``ConfigError`` for one
    the command cannot read (a malformed URL, the in-memory store) and ``FileNotFoundError`` for
    a SQLite file that is not there (opening it would create an empty log)."""
    env = os.environ
    if a.store:
        url, source = a.store, "--store"
    elif env.get("KIT_STORE"):
        url, source = env["KIT_STORE"], "KIT_STORE"
    else:
        project = env.get("KIT_PROJECT", ".kit")
        url, source = project_log_url(project), f"the project {project} (KIT_PROJECT)"
    store = store_from_url(url)  # ConfigError naming a malformed URL
    if url == "memory":
        raise ConfigError(f"{source} names the in-memory store, whose log lives and dies with its "
                          "process: pass --store sqlite:///path/to/kit.db")
    if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
        raise FileNotFoundError(f"no event log at {url[len('sqlite:///'):]} (from {source}); pass "
                                "--store sqlite:///path/to/kit.db, or set KIT_STORE or KIT_PROJECT")
    return store


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kit`` command; returns the exit code."""
    a = _parser().parse_args(argv)
    try:
        store = _store(a)
    except ConfigError as exc:
        print(f"kit: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"kit: {exc}", file=sys.stderr)
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
        print(f"kit: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the store could not be read: say why, exit 1
        print(f"kit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
