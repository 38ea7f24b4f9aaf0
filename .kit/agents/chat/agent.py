"""The example chat agent: answers with the help of a clock tool and the release-notes skill
(``.kit/skills/release-notes/SKILL.md``, which it loads with its ``load_skill`` tool).

Offline by default: without OPENAI_API_KEY it plays kit's ScriptedModel (a scripted reply,
streamed word by word); with the key it uses KIT_MODEL (default gpt-4o-mini).
"""
import os
from datetime import datetime, timezone

import kit


def current_time() -> str:
    """The current date and time in UTC (ISO 8601)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


OFFLINE = kit.ScriptedModel([
    {"tool": "current_time", "args": {}},
    "I checked the clock tool, so I can tell you the time in UTC. This reply comes from kit's "
    "offline scripted model; set OPENAI_API_KEY to talk to a real one.",
], cycle=True)

agent = kit.Agent(
    "chat",
    "You are a concise, friendly assistant. Use the current_time tool for anything about time.",
    tools=[current_time],
    skills=["release-notes"],
    model=os.environ.get("KIT_MODEL", "gpt-4o-mini") if os.environ.get("OPENAI_API_KEY") else OFFLINE,
)
