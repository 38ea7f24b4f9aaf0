"""kit_mcp_servers: the MCP servers a deck's agents take tools from, kept alive.

Owns: the SDK's MCP server objects a deck builds from its ``MCP`` config (``mcp_servers``: kit's
watched subclasses of the SDK's stdio, streamable-HTTP and SSE classes), ``ServerHolder``, which
connects them when the deck opens, restarts one that died and closes them with the deck (a
server that is down is a ``kit_core.MCPServerError``). kit_mcp is the other direction: kit's own
MCP server surface.

Must never: reach the event store or the Runtime, import kit_runtime or anything above it, touch
asyncio directly (kit_bridge does), or replay a tool call (it may have done its work).

Theory of operation
-------------------
MCP servers are connected when the deck opens, each by its own engine-side task
(``ServerHolder._keep``): the MCP client's cancel scopes must be left, in order, by the task
that entered them. The SDK lists an agent's MCP tools before every model call and never
reconnects, so kit's server classes (``_HeldServer``) watch each request for a *death*: a closed
connection (a stdio server's exit code is named), a streamable-HTTP server's 404 for the
session (it restarted and forgot it), or a ``list_tools`` that outlasts the server's timeout (it
hangs). The first run to meet a death asks for one restart (cleanup, which kills a
hung process, then connect, in the server's task); runs that meet the same death wait for that
restart (a connection generation tells deaths apart). A tool call cut short is never replayed
(it may have had effects): the model is told, as for any tool error. A listing is replayed once
on the restarted server, so the turn goes on. A failed restart leaves the server down for the
deck's life: every later use fails at once with ``MCPServerError`` (no retry storm against a
server that cannot start; reopening the deck starts it). The mcp package starts a stdio server
as the leader of its own process group but kills the group only if the server outlives its
closed stdin; kit ends what is left of the group after each cleanup (``_end_group``), so
helpers a server spawned never outlive it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import httpx
from agents.mcp import MCPServerSse, MCPServerStdio, MCPServerStreamableHttp
from mcp.shared.exceptions import McpError
from mcp.types import CONNECTION_CLOSED, INTERNAL_ERROR, ErrorData

from kit_core import MCPServerError

if TYPE_CHECKING:
    from kit_catalog import MCP

__all__ = ("ServerHolder", "mcp_servers", "GROUP_GRACE", "EXIT_WAIT")

#: What is left of a stdio server's process group after the mcp package's cleanup (helpers the
#: server spawned) gets this long after SIGTERM before SIGKILL; it costs nothing when no helper
#: is left, and bounds closing the deck when one ignores SIGTERM.
GROUP_GRACE = 1.0
#: How long a run that found a stdio server's connection closed waits for the exit code to name
#: it (asyncio learns it a moment after the pipe closes; a server that closed its stdout but
#: lives on is named as such after this long).
EXIT_WAIT = 1.0

_log = logging.getLogger("kit.agents")  # its restarts: the logger kit-serve prints
#: What the mcp package's streamable-HTTP client says when the server answers 404 for the
#: session (the MCP spec: the client must then start a new one).
_SESSION_GONE = "Session terminated"


class _HeldServer:
    """What kit adds to the SDK's server classes: each request watched for the server's death,
    and a death mended by one restart, by the server's task in the ``ServerHolder``.

    State, all on the engine side: ``_gen`` counts connections (a death seen on an older one is
    mended already); ``_restart`` is set while a restart is asked for or under way (requests
    wait on it); ``_down`` holds ``(what, then)`` once one failed; ``_end``, set by the holder
    while it holds a connection, ends that connection when set (no holder: a death is reported,
    never mended).
    """

    _gen, _what, _process = 0, "", None
    _restart: anyio.Event | None = None
    _end: anyio.Event | None = None
    _down: tuple[str, str] | None = None
    name: str
    client_session_timeout_seconds: float | None

    async def list_tools(self, run_context: Any = None, agent: Any = None) -> Any:
        """The SDK's listing (before every model call); on a death, once more on the restarted
        server. Raises ``MCPServerError`` for a server that is down or fails the listing."""
        for last in (False, True):
            gen, process = await self._usable()
            try:
                return await super().list_tools(run_context, agent)  # type: ignore[misc]
            except Exception as exc:
                what = await self._death(exc, process, listing=True)
                if what is None:
                    raise MCPServerError(self.name,
                                         f"failed list_tools ({_describe(exc)})") from exc
                mending = self._ask_restart(gen, what)
                if last or not mending:
                    raise MCPServerError(self.name, what, "kit is restarting it" if mending
                                         else None) from exc

    async def call_tool(self, tool_name: str, arguments: Any, meta: Any = None) -> Any:
        """The SDK's tool call, never replayed: on a death the restart is asked for and the call
        fails with ``MCPServerError`` (its text goes to the model). A result the server marks
        ``isError`` (the tool failed) is raised as an ``McpError`` quoting its text, so the
        call's ``tool.completed`` says ``is_error`` as for any refusal."""
        gen, process = await self._usable()
        try:
            result = await super().call_tool(tool_name, arguments, meta)  # type: ignore[misc]
        except Exception as exc:
            what = await self._death(exc, process, listing=False)
            if what is None:
                raise
            mending = self._ask_restart(gen, what)
            raise MCPServerError(self.name, what, f"the call to {tool_name} did not finish"
                                 + ("; kit is restarting the server" if mending else "")) from exc
        if getattr(result, "isError", False):  # the tool failed: MCP says so in its result,
            # which the SDK would hand the model as a success; raised, it is a refusal like any
            raise McpError(ErrorData(code=INTERNAL_ERROR, message=" ".join(
                c.text for c in result.content if getattr(c, "type", None) == "text")
                or f"the tool {tool_name} failed"))
        return result

    async def _usable(self) -> tuple[int, Any]:
        if self._restart is not None:  # bounded by the restart itself (module docstring)
            await self._restart.wait()
        if self._down is not None:
            raise MCPServerError(self.name, *self._down)
        return self._gen, self._process

    async def _death(self, exc: Exception, process: Any, *, listing: bool) -> str | None:
        """What the failure ``exc`` says happened to the server, if it died; None for a refusal
        or a slow tool call (the server still answers)."""
        if isinstance(exc, (anyio.ClosedResourceError, anyio.BrokenResourceError,
                            anyio.EndOfStream)) or (
                isinstance(exc, McpError) and exc.error.code == CONNECTION_CLOSED) or (
                isinstance(exc.__cause__, httpx.ConnectError)):  # the SDK's "Connection lost"
            if process is not None:
                with anyio.move_on_after(EXIT_WAIT):
                    await process.wait()
            return _gone(process)
        if listing and isinstance(exc, McpError) and exc.error.code == httpx.codes.REQUEST_TIMEOUT:
            return f"did not answer list_tools in {self.client_session_timeout_seconds:g} s"
        if isinstance(exc, McpError) and exc.error.message == _SESSION_GONE:
            # An HTTP 404 for the session (the mcp client's words): the server restarted, or
            # dropped it; every later request would get the same, so it is mended by a new one.
            return "forgot the session (HTTP 404: it restarted?)"
        return None

    def _ask_restart(self, gen: int, what: str) -> bool:
        """Ask the holder to mend the death seen on connection ``gen``, unless that was asked
        already (one death, one restart); returns whether a restart is coming or came."""
        if self._end is None or self._down is not None:
            return False
        if gen == self._gen and self._restart is None:
            self._what, self._restart = what, anyio.Event()
            self._end.set()
        return True

    def _settle(self, then: str | None) -> None:
        """The holder's word on the restart asked for: done (None), or why the server stays down."""
        if then is None:
            self._gen += 1
            _log.warning("MCP server %r %s; kit restarted it", self.name, self._what)
        else:
            self._down = (self._what, then)
            _log.error("MCP server %r %s; %s", self.name, self._what, then)
        done, self._restart = self._restart, None
        if done is not None:
            done.set()


class _HeldStdio(_HeldServer, MCPServerStdio):
    """A stdio server whose process kit knows: its exit code names its death, and what is left
    of its process group is ended after the mcp package's cleanup (``_end_group``)."""

    def create_streams(self) -> Any:
        return self._streams()

    @contextlib.asynccontextmanager
    async def _streams(self) -> AsyncIterator[Any]:
        client, process = super().create_streams(), None
        self._process = None
        try:
            async with client as streams:
                process = self._process = _process_of(client)
                yield streams
        finally:
            if process is not None and hasattr(os, "killpg"):
                await _end_group(process.pid)


class _HeldHttp(_HeldServer, MCPServerStreamableHttp):
    """A streamable-HTTP server, watched (a restart is a new connection)."""


class _HeldSse(_HeldServer, MCPServerSse):
    """An SSE server, watched (a restart is a new connection)."""


def _process_of(client: Any) -> Any:
    """The server process of the mcp package's ``stdio_client`` once entered: a local of its
    generator, which the package exposes nowhere else. None if that ever changes: kit then names
    a death without its exit code and leaves the process group to the package."""
    frame = getattr(getattr(client, "gen", None), "ag_frame", None)
    process = frame.f_locals.get("process") if frame is not None else None
    return process if isinstance(getattr(process, "pid", None), int) else None


async def _end_group(pgid: int) -> None:
    """End what is left of a stdio server's process group (the server ran as its leader: the
    mcp package starts it in a new session): SIGTERM, up to ``GROUP_GRACE``, then SIGKILL.
    Shielded: it runs as the deck closes, and a helper must not outlive it."""
    with anyio.CancelScope(shield=True):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return  # the usual case: nothing is left
        with anyio.move_on_after(GROUP_GRACE):
            while True:  # the OS offers no wait for a group that is not our child: poll it
                await anyio.sleep(0.05)
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _gone(process: Any) -> str:
    """What a closed connection says of a server whose process is ``process`` (None: not ours)."""
    code = getattr(process, "returncode", None)
    if code is None:
        return "closed the connection" if process is None else "closed its stdout"
    try:
        how = f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    except ValueError:
        how = f"killed by signal {-code}"
    return f"is gone ({how})"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def mcp_servers(mcp: MCP | None) -> dict[str, Any]:
    """One unconnected SDK server object per server of ``mcp`` (connected when the deck opens),
    of kit's watched classes (``_HeldServer``)."""
    out: dict[str, Any] = {}
    for name, s in (mcp.servers if mcp is not None else {}).items():
        kw = {"name": name, "client_session_timeout_seconds": s["timeout"]}
        if s["type"] == "stdio":
            params: dict[str, Any] = {"command": s["command"], "args": list(s["args"])}
            if s["env"] is not None:  # the child inherits nothing unless given env
                params["env"] = {**os.environ, **s["env"]}
            if s["cwd"] is not None:
                params["cwd"] = s["cwd"]
            out[name] = _HeldStdio(params=params, **kw)  # type: ignore[arg-type]
        else:
            cls = _HeldSse if s["type"] == "sse" else _HeldHttp
            out[name] = cls(params={"url": s["url"], "headers": dict(s["headers"]),
                                    "timeout": s["timeout"]}, **kw)  # type: ignore[arg-type]
    return out


class ServerHolder:
    """Connects a deck's MCP servers, restarts one that died, and holds them open until ``stop``.

    ``hold`` runs on the engine side, one task per server under it (``_keep``): the MCP client's
    cancel scopes must be left in order by the task that entered them, so connect and cleanup of
    a server run in its own task, nothing entered between, and a restart is a cleanup then a
    connect there (one task for all servers would leave one server's scopes under another's).
    ``ready`` (a kit-side event, set through ``to_kit``) fires once every server is connected or
    one failed: then ``error`` and ``failed`` (the server's name) say which, and the servers
    already connected are cleaned up. ``stop`` is called on the engine side (through the bridge
    under trio); a restart under way finishes first (bounded: see ``_keep``).
    """

    def __init__(self, servers: Sequence[Any], to_kit: Callable[[Callable[[], Any]], Any]) -> None:
        self.servers, self._to_kit = list(servers), to_kit
        self.ready = anyio.Event()
        self.error: BaseException | None = None
        self.failed: str | None = None
        self._stopping = False

    async def hold(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                try:
                    for server in self.servers:
                        self.failed = server.name
                        await tg.start(self._keep, server)
                    self.failed = None
                except Exception as exc:  # reported by the Runtime once the others closed
                    self.error = exc
                    self.stop()
                else:
                    self._to_kit(self.ready.set)
        except Exception as exc:  # never left to crash the Runtime's task group
            self.error = self.error or exc
        finally:
            self._to_kit(self.ready.set)

    async def _keep(self, server: _HeldServer, *, task_status: Any = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        """One server's task: connect; hold the connection until a restart is asked for or the
        deck closes; clean up; for a restart, connect again. Cleanup is bounded by the mcp
        package (a stdio server gets 2 s after its stdin closes, then its group SIGTERM, 2 s,
        SIGKILL; then ``_end_group``), connect by the server's timeout.

        A server that dies can make its transport's task group, entered by ``connect`` in this
        task, cancel this task (a write to a dead stdio server fails): that cancellation is
        owned by the transport's scopes, which the SDK's cleanup leaves (inside a failed
        ``connect``; below, after the wait), so it is caught here rather than ending every
        server's task. A cancellation from outside is level-triggered: it is raised again by
        the checkpoint that follows each cleanup, and goes on from there.
        """
        first, cancelled = True, anyio.get_cancelled_exc_class()
        try:
            while not self._stopping:
                server._end = end = anyio.Event()
                try:
                    await server.connect()  # type: ignore[attr-defined]
                except (Exception, cancelled) as exc:
                    await anyio.lowlevel.checkpoint()
                    if isinstance(exc, cancelled) or (  # the transport's: the server died
                            isinstance(exc, McpError) and exc.error.code == CONNECTION_CLOSED):
                        # its exit code, not the mcp package's bare "Connection closed"
                        if server._process is not None:
                            with anyio.move_on_after(EXIT_WAIT):
                                await server._process.wait()
                        exc = ConnectionError(f"it {_gone(server._process)} while connecting")
                    if first:
                        raise exc from None  # the deck's open fails, naming the server
                    server._settle(f"restarting it failed ({_describe(exc)}); it stays down "
                                   "until the deck is reopened")
                    return
                if first:
                    first = False
                    task_status.started()
                else:
                    server._settle(None)
                died = False
                try:
                    await end.wait()
                except cancelled:  # the transport's own (docstring): the server died
                    died = True
                await server.cleanup()  # type: ignore[attr-defined]
                await anyio.lowlevel.checkpoint()
                if died:  # before any run met it: the restart is this task's to ask for
                    server._ask_restart(server._gen, _gone(server._process))
        finally:
            server._end = None
            if server._restart is not None:
                server._settle("the deck is closing")

    def stop(self) -> None:
        self._stopping = True
        for server in self.servers:
            if server._end is not None:
                server._end.set()
