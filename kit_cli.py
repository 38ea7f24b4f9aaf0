"""kit_cli: the ``kit`` console script (argparse), a thin reader and writer of the event store.

Owns: argv parsing, choosing the store (``--store`` or ``KIT_STORE``) and printing what it reads.
Must never: start or render a conversation (SPEC 1); print the application context or secrets.

Commands:
  kit runs list [--store URL] [--status S] [--name N] [--session ID] [--json]
      The run index, oldest first: one line per run (run id, status, name, session, start).
  kit runs signal <run_id> {pause,cancel,resume} [--store URL] [--reason TEXT]
      Records the request for a run another process plays; that process acts on it at the run's
      next safe point (a resume is taken up by a deck that has the run's agent or workflow).
Exit codes: 0 done (or recorded), 1 an unknown run, a request that cannot act on the run (a
finished run; pause of a parked run; resume of a run that is not paused: the message says its
status) or a store that cannot be read, 2 a usage error (clig.dev conventions).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import anyio

from kit_core import ConfigError, EventStorePort, RunStatus, UnknownRunError, control_refusal
from kit_store import store_from_url

__all__ = ("main",)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kit", description="Inspect kit's event log.")
    commands = p.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="runs in the event log").add_subparsers(
        dest="action", required=True)
    ls = runs.add_parser("list", help="list runs, oldest first")
    ls.add_argument("--store", help="event store URL (default: $KIT_STORE), e.g. sqlite:///.kit/.state/kit.db")
    ls.add_argument("--status", choices=[s.value for s in RunStatus])
    ls.add_argument("--name", help="only runs of this agent or workflow")
    ls.add_argument("--session", help="only runs of this session id")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    sig = runs.add_parser("signal", help="ask a run to pause, cancel or resume")
    sig.add_argument("run_id")
    sig.add_argument("signal", choices=["pause", "cancel", "resume"])
    sig.add_argument("--store", help="event store URL (default: $KIT_STORE)")
    sig.add_argument("--reason", help="recorded with the request")
    return p


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
        infos = await store.runs(status=RunStatus(a.status) if a.status else None,
                                 name=a.name, session_id=a.session)
    for i in infos:
        if a.json:
            print(json.dumps({"run_id": i.run_id, "status": i.status.value, "name": i.name,
                              "invocable": i.invocable, "session_id": i.session_id,
                              "namespace": i.namespace, "started_at": i.started_at.isoformat(),
                              "parent_run_id": i.parent_run_id}))
        else:
            print(f"{i.run_id}  {i.status.value:<13} {i.name:<20} {i.session_id or '-':<20} "
                  f"{i.started_at.isoformat(timespec='seconds')}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kit`` command; returns the exit code."""
    a = _parser().parse_args(argv)
    url = a.store or os.environ.get("KIT_STORE")
    if not url:
        print("kit: no event store: pass --store URL or set KIT_STORE", file=sys.stderr)
        return 2
    try:
        store = store_from_url(url)
    except ConfigError as exc:
        print(f"kit: {exc}", file=sys.stderr)
        return 2
    if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
        print(f"kit: no event log at {url[len('sqlite:///'):]}", file=sys.stderr)
        return 1
    try:
        anyio.run(_list if a.action == "list" else _signal, store, a)
    except (UnknownRunError, _Refused) as exc:
        print(f"kit: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the store could not be read: say why, exit 1
        print(f"kit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
