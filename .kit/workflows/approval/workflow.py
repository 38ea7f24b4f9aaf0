"""The example approval workflow: draft, wait for a human's answer, then publish or drop.

Durable: its threads live in the project's SQLite file, so a pending approval survives a
restart. Start it with a thread id, answer it with POST /workflows/approval/<thread_id>/resume.
"""
import operator
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph

import kit


class Input(TypedDict, total=False):
    """What a caller sets (anything else in the input is ignored): the log is the workflow's."""
    title: str


class State(Input, total=False):
    log: Annotated[list[str], operator.add]
    approved: bool


async def draft(state: State) -> dict:
    return {"log": [f"drafted {state.get('title', 'an untitled release')!r}"]}


async def approve(state: State) -> dict:
    answer = kit.interrupt({"question": "Publish this release?", "title": state.get("title")})
    approved = answer in (True, "yes", "approve", "approved")
    return {"approved": approved, "log": [f"answer: {answer!r}"]}


async def publish(state: State) -> dict:
    return {"log": ["published" if state.get("approved") else "dropped"]}


graph = StateGraph(State, input_schema=Input)
graph.add_node("draft", draft).add_node("approve", approve).add_node("publish", publish)
graph.add_edge(START, "draft").add_edge("draft", "approve").add_edge("approve", "publish")
graph.add_edge("publish", END)

workflow = kit.Workflow("approval", graph, durable=True)
