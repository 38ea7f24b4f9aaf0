"""kit_context: the build-time check of the per-run application context (SPEC 4.2).

Owns: finding the parameters annotated ``Context[...]`` in a callable (``context_params``),
deciding whether a declared context type satisfies one (``context_fits``), and walking a compiled
catalog's injection sites (``check_context``): tools, instructions callables, hook methods and
workflow nodes (a compiled subgraph's too: ``workflow_nodes``).

Must never: do I/O, import an engine SDK or a sibling above ``kit_core``, or look at a context
*object* (only types: the object reaches the callables at run time and is never stored).

Theory of operation: ``Deck.build()`` calls ``check_context`` when the deck declares
``context=``. A site whose requirement the declared type cannot satisfy is a ``ContextTypeError``
naming the site; a requirement the runtime cannot rule on (a TypeVar, a protocol with data members,
an annotation that does not evaluate) is deferred to invocation, never refused.
"""
from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from kit_core import Context, ContextTypeError, InvocableSpec

__all__ = ("context_fits", "check_context")

#: The hook methods an agent's ``hooks`` object may define (the SDK's ``AgentHooks``); each
#: receives a ``Context`` in place of the SDK's context argument.
HOOK_METHODS = ("on_start", "on_end", "on_handoff", "on_tool_start", "on_tool_end",
                "on_llm_start", "on_llm_end")


#: A ``Context[...]`` requirement kit cannot resolve (a string annotation that does not evaluate):
#: deferred to invocation, like the other cases the build-time check cannot rule on (SPEC 4.2).
_UNREADABLE = object()


def context_params(fn: Any) -> dict[str, Any]:
    """The parameters of ``fn`` annotated ``Context[...]``, each with the type it requires
    (``Any`` for a bare ``Context``, ``_UNREADABLE`` when its annotation cannot be evaluated)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    found = {n: p.annotation for n, p in sig.parameters.items() if is_context(p.annotation)}
    if not found:
        return {}
    target = fn.func if isinstance(fn, functools.partial) else fn
    if not (inspect.isroutine(target) or isinstance(target, type)):
        target = type(target).__call__  # a callable object: its class's __call__ holds the hints
    try:  # read through to the function (`from __future__ import annotations` included)
        hints = typing.get_type_hints(target)
    except Exception:  # an annotation naming something not importable here
        hints = {}
    out = {}
    for name, annotation in found.items():
        annotation = context_of(hints.get(name, annotation))
        if isinstance(annotation, str):
            out[name] = _UNREADABLE
        else:
            out[name] = typing.get_args(annotation)[0] if typing.get_args(annotation) else Any
    return out


def context_fits(required: Any, provided: Any) -> bool | None:
    """SPEC 4.2: may a callable requiring ``Context[required]`` run with a ``provided`` object?

    True or False, or None when the runtime cannot rule (deferred to invocation): ``Any`` and
    a bare ``Context`` fit anything; a class fits its subclasses (exact type or supertype); a
    parameterised ABC such as ``Mapping[str, Any]`` is checked as the ABC, parameters ignored; a
    runtime-checkable protocol with only methods is checked structurally; a required union fits
    when an arm does, a provided one (``Deps | None``) when each of its arms fits (its exact
    type always does); a TypeVar, another protocol, an annotation kit cannot read, or a
    declared ``Any`` is deferred.
    """
    if required is Any or required == provided:
        return True
    if required is _UNREADABLE or isinstance(required, typing.TypeVar) or provided is Any:
        return None  # a declared Any says nothing kit could rule on (it is a class since 3.11)
    if typing.get_origin(provided) in (typing.Union, types.UnionType):  # each arm must fit
        verdicts = [context_fits(required, arm) for arm in typing.get_args(provided)]
        return False if False in verdicts else True if all(verdicts) else None
    origin = typing.get_origin(required)
    if origin in (typing.Union, types.UnionType):
        verdicts = [context_fits(arm, provided) for arm in typing.get_args(required)]
        return True if True in verdicts else None if None in verdicts else False
    if origin is not None:
        required = origin  # the ABC (or class) of a parameterised type; parameters ignored
    if not isinstance(required, type):
        return None
    if getattr(required, "_is_protocol", False) and not getattr(required, "_is_runtime_protocol", False):
        return None
    try:
        return issubclass(typing.get_origin(provided) or provided, required)
    except TypeError:  # a protocol with data members: the runtime refuses to rule
        return None


def check_context(specs: Sequence[InvocableSpec], provided: Any) -> None:
    """Walk every injection site of the catalog and refuse an incompatible requirement.

    Sites: an agent's tools (SDK tool objects are deferred), its instructions callable, its
    hook methods, and every workflow node. Raises ``ContextTypeError`` naming the site, what it
    requires and what the deck provides.
    """
    for spec in specs:
        if spec.kind == "agent":
            agent = spec.source
            sites = [(f"tool {site_name(t, '__name__')} of agent {agent.name!r}", t)
                     for t in agent.tools if callable(t)]  # SDK tool objects: deferred
            if callable(agent.instructions):
                fn = agent.instructions
                sites.append((f"instructions callable {site_name(fn, '__qualname__')} of agent "
                              f"{agent.name!r}", fn))
            for method in HOOK_METHODS:
                fn = getattr(agent.hooks, method, None) if agent.hooks is not None else None
                if fn is not None:
                    sites.append((f"hook {method} of agent {agent.name!r}", fn))
        else:
            sites = [(f"node {name} of workflow {spec.name!r}", fn)
                     for name, fn in workflow_nodes(spec.source.graph)]
        for site, fn in sites:
            for required in context_params(fn).values():
                if context_fits(required, provided) is False:
                    raise ContextTypeError(site, required, provided)


def site_name(fn: Any, attr: str) -> str:
    """A callable's name for a message: a partial's is its function's (never its bound arguments,
    which may be secrets), an object's its class's."""
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(fn, attr, None) or type(fn).__qualname__


def is_context(annotation: Any) -> bool:
    """Is a parameter so annotated given the run's context? (``Context[...]``, also inside
    ``Annotated[...]`` or an ``Optional``, which kit never fills with None.)"""
    return context_of(annotation) is not None


#: A postponed annotation (`from __future__ import annotations`) that names a Context: as
#: written, or inside ``Annotated[...]``/``Optional[...]``, or ``| None`` after it.
_CONTEXT_TEXT = re.compile(r"(?:(?:typing\.)?(?:Annotated|Optional)\[\s*)?(?:kit\.)?Context\b")


def context_of(annotation: Any) -> Any:
    """The ``Context`` annotation a parameter's annotation is or holds, else None; a postponed
    one kit could not evaluate is given back as its text."""
    if isinstance(annotation, str):
        return annotation if _CONTEXT_TEXT.match(annotation) else None
    if typing.get_origin(annotation) is typing.Annotated:
        return context_of(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(annotation) if arm is not type(None)]
        return context_of(arms[0]) if len(arms) == 1 else None
    return annotation if annotation is Context or typing.get_origin(annotation) is Context else None


def workflow_nodes(graph: Any, path: str = "", above: tuple[int, ...] = ()
                   ) -> Iterator[tuple[str, Any]]:
    """The nodes of a ``StateGraph`` as ``(name, function)``, a compiled subgraph's too (named
    ``inner/node``, as in an event's origin); the function is None when a node is not a plain
    one. ``above``: the builders that hold ``graph`` (one that holds its own compiled graph is
    walked once)."""
    for name, node in graph.nodes.items():
        yield path + name, node_function(node)
        builder = getattr(node.runnable, "builder", None)  # a compiled subgraph's StateGraph
        if isinstance(getattr(builder, "nodes", None), dict) and id(builder) not in above:
            yield from workflow_nodes(builder, f"{path}{name}/", (*above, id(graph)))


def node_function(node: Any) -> Any:
    """The function a ``StateGraph`` node was added with (None when it is not a plain one)."""
    runnable = node.runnable
    return getattr(runnable, "func", None) or getattr(runnable, "afunc", None)
