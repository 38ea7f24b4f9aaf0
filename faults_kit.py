"""faults_kit: kill -9 trials of kit-serve under streaming load, checking what clients were told.

Each trial serves a project (an agent that streams a long reply at a few hundred tokens a second)
with a real ``kit-serve`` on a real SQLite file, opens ``--clients`` streaming chats, SIGKILLs the
server at a random moment once a client's stream has begun, starts it again on the same file, and checks, for every client:

- every frame it received is in the log, at the same seq, with the same kind and payload (a
  ``data: {"delta"}`` frame is that seq's ``text.delta``; ``event: done`` its ``run.completed``);
- no seq it holds was reused for another event (the check above, per frame);
- a reconnect with the last id it saw (``GET /runs/{id}/events``, ``Last-Event-ID``) reaches the
  run's end: a terminal event (``run.failed`` RunAbandoned for a run the kill cut, recorded by the
  restarted server once the dead one's lease lapsed), or 204 when it had seen the end already;

and that ``PRAGMA integrity_check`` says ok. Prints the counts. ``test_kit_faults.py`` runs a few
trials in CI; run ``python faults_kit.py --trials 50`` for the figures.

Usage: python faults_kit.py [--trials N] [--clients N] [--worker asyncio|trio] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

AGENT = '''
import anyio, kit

class Slow(kit.ScriptedModel):
    """Streams at a human pace, so a kill lands mid-reply."""
    async def stream_response(self, *args, **kw):
        async for ev in super().stream_response(*args, **kw):
            if getattr(ev, "type", "") == "response.output_text.delta":
                await anyio.sleep(0.003)
            yield ev

agent = kit.Agent("slow", model=Slow([" ".join(f"w{i}" for i in range(400))], cycle=True))
'''
#: Lease of the trial servers: after a kill, the restarted server records the dead one's runs
#: as abandoned within about this long (seconds).
LEASE = "1"


@dataclass
class Counts:
    trials: int = 0
    clients: int = 0
    frames: int = 0
    missing: int = 0  # frames a client received that the log lacks
    mismatched: int = 0  # frames whose seq holds another event in the log (a reused seq)
    reconnects: int = 0
    reached_end: int = 0
    integrity_failures: int = 0
    killed_mid_stream: int = 0
    problems: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return not (self.missing or self.mismatched or self.integrity_failures
                    or self.reached_end != self.reconnects)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(project: Path, port: int, worker: str) -> subprocess.Popen:
    env = {**os.environ, "KIT_PROJECT": str(project), "KIT_LEASE_SECONDS": LEASE, "HOST": "127.0.0.1",
           "PORT": str(port), "KIT_WORKER": worker}
    env.pop("KIT_STORE", None)
    proc = subprocess.Popen([sys.executable, "-m", "kit_serve"], env=env, cwd=Path(__file__).parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("kit-serve did not start")


def _frames(lines) -> list[tuple[int, str, dict]]:
    """(seq, event, data) per SSE frame of ``lines``."""
    out, seq, event = [], None, "message"
    for line in lines:
        if line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            if seq is not None:
                out.append((seq, event, json.loads(line[6:])))
            seq, event = None, "message"
    return out


def _client(base: str, session: str, got: dict) -> None:
    """Stream one chat until the server dies; keep every complete frame with an id."""
    lines: list[str] = []
    try:
        with httpx.stream("POST", f"{base}/agents/slow/chat?stream=true", timeout=60,
                          json={"session_id": session, "message": "talk"}) as r:
            got["run_id"] = r.headers.get("x-kit-run-id")
            for line in r.iter_lines():
                lines.append(line)
    except httpx.HTTPError:
        pass  # the kill
    # Only frames that ended with their blank line were received whole.
    complete = lines[:len(lines) - lines[::-1].index("")] if "" in lines else []
    got["frames"] = _frames(complete)


def _matches(frame: tuple[int, str, dict], event: dict) -> bool:
    seq, kind, data = frame
    if kind == "message":
        return event["kind"] == "text.delta" and event["payload"]["text"] == data["delta"]
    if kind == "done":
        return event["kind"] == "run.completed" and event["payload"]["output"] == data["output"]
    if kind == "error":
        return event["kind"] in ("run.failed", "run.cancelled")
    return False


def _reconnect(base: str, run_id: str, last: int) -> bool:
    """Pick the run up after ``last``: True when it reaches the run's end."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        headers = {"Last-Event-ID": str(last)} if last >= 0 else {}
        with httpx.stream("GET", f"{base}/runs/{run_id}/events", headers=headers, timeout=30) as r:
            if r.status_code == 204:
                return True  # the client had the end already
            if r.status_code != 200:
                return False
            frames = _frames(r.iter_lines())
        if frames and frames[-1][1] in ("run.completed", "run.failed", "run.cancelled"):
            return True
        last = frames[-1][0] if frames else last
    return False


def trial(counts: Counts, workdir: Path, clients: int, worker: str, rng: random.Random) -> None:
    project = workdir / f"project{counts.trials}"
    (project / "agents" / "slow").mkdir(parents=True)
    (project / "agents" / "slow" / "agent.py").write_text(AGENT)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = _start(project, port, worker)
    results = [{} for _ in range(clients)]
    threads = [threading.Thread(target=_client, args=(base, f"s{i}", results[i]), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20  # a loaded machine answers late: the kill lands mid-stream
    while not any("run_id" in got for got in results) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.1, 1.0))
    server.send_signal(signal.SIGKILL)
    server.wait()
    for t in threads:
        t.join(30)
    server = _start(project, port, worker)
    try:
        db = project / ".state" / "kit.db"
        for got in results:
            counts.clients += 1
            run_id, frames = got.get("run_id"), got.get("frames", [])
            if not run_id:
                continue
            counts.frames += len(frames)
            if frames and frames[-1][1] not in ("done", "error"):
                counts.killed_mid_stream += 1
            log = {e["seq"]: e for e in httpx_log(base, run_id)}
            for frame in frames:
                if frame[0] not in log:
                    counts.missing += 1
                    counts.problems.append(f"{run_id}: seq {frame[0]} missing")
                elif not _matches(frame, log[frame[0]]):
                    counts.mismatched += 1
                    counts.problems.append(f"{run_id}: seq {frame[0]} is {log[frame[0]]['kind']}")
            counts.reconnects += 1
            counts.reached_end += _reconnect(base, run_id, frames[-1][0] if frames else -1)
        with sqlite3.connect(db) as con:
            if con.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                counts.integrity_failures += 1
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    counts.trials += 1


def httpx_log(base: str, run_id: str) -> list[dict]:
    """The run's log as committed, read over the native events route once the run has ended
    (the restarted server records a killed run's end after the lease)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with httpx.stream("GET", f"{base}/runs/{run_id}/events", timeout=30) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        if events and events[-1]["kind"] in ("run.completed", "run.failed", "run.cancelled"):
            return events
        time.sleep(0.1)
    return events


def run_trials(n: int, clients: int = 4, worker: str = "asyncio", seed: int | None = None) -> Counts:
    counts, rng = Counts(), random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kit-faults-") as tmp:
        for _ in range(n):
            trial(counts, Path(tmp), clients, worker, rng)
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--worker", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    started = time.monotonic()
    c = run_trials(a.trials, a.clients, a.worker, a.seed)
    print(f"kit faults: {c.trials} kill -9 trials, {c.clients} streaming clients "
          f"({c.killed_mid_stream} cut mid-stream), {a.worker} worker, {time.monotonic() - started:.0f} s")
    print(f"  frames received           {c.frames:>8,}")
    print(f"  missing from the log      {c.missing:>8,}")
    print(f"  seq holding another event {c.mismatched:>8,}")
    print(f"  reconnects reaching end   {c.reached_end:>8,} of {c.reconnects:,}")
    print(f"  integrity_check failures  {c.integrity_failures:>8,}")
    for problem in c.problems[:20]:
        print(f"  ! {problem}")
    return 0 if c.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
