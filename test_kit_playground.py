"""Tests of the playground page (``GET /``, kit_playground.html): a real kit-serve on loopback
serving a copy of the example project (plus two slow agents), driven in headless Chromium by
Playwright the way a person would use it; a screenshot of each scenario lands in the test's tmp
dir. Also: ``--no-playground`` / ``KIT_PLAYGROUND=0``, and the page's own headers."""
from __future__ import annotations

import json
import re
import shutil
import types

import httpx
import pytest

from test_kit_http import HERE, catalog, served
from test_kit_serve import kit_serve, stop

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips the browser tests (fails them in CI)
    expect = None

AGENT = '''
import asyncio
import kit


async def nap(seconds: float) -> str:
    """Sleep a while."""
    await asyncio.sleep(seconds)
    return "rested"


agent = kit.Agent("{name}", tools=[nap], skills={skills!r},
                  model=kit.ScriptedModel({script!r}, cycle=True))
'''
NAP = {"tool": "nap", "args": {"seconds": 0.5}}
AGENTS = {"sleepy": ([NAP], []), "napper": ([NAP, "rested"], []),
          "reader": ([{"tool": "load_skill", "args": {"name": "release-notes"}}, "read"], ["release-notes"])}
#: Seconds a step of a scenario may take (a page action, a run), on a loaded 2-core machine.
STEP = 15_000



# ------------------------------------------------------------------ without a browser ----

@pytest.mark.anyio
async def test_the_page_is_served_with_a_strict_policy_and_stays_off_the_v1_routes():
    async with served(catalog()) as (client, _):
        r = await client.get("/")
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'sha256-" in csp
        assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        page = r.text
        assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page  # self-contained
        assert "http://" not in page and "https://" not in page  # no CDN, works offline
        assert not re.search(r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|eval\(", page)
        assert (await client.get("/health")).json()["status"] == "ok"
        r = await client.post("/", json={})
        assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")


@pytest.mark.anyio
async def test_kit_playground_0_turns_the_page_off(monkeypatch):
    monkeypatch.setenv("KIT_PLAYGROUND", "0")
    async with served(catalog()) as (client, app):
        assert not app.playground
        r = await client.get("/")
        assert (r.status_code, r.json()["error"]) == (404, "RouteNotFoundError")
        paths = (await client.get("/openapi.json")).json()["paths"]
        assert "/" not in paths and "/health" in paths


def test_kit_serve_no_playground_and_its_startup_line(tmp_path):
    project = tmp_path / "proj"
    shutil.copytree(HERE / ".kit", project, ignore=shutil.ignore_patterns(".state"))
    proc, base = kit_serve(project, "--no-playground", KIT_ALLOWED_HOSTS="kit.test,127.0.0.1")
    try:
        r = httpx.get(f"{base}/")
        assert (r.status_code, r.json()["error"]) == (404, "RouteNotFoundError")
    finally:
        line = stop(proc).splitlines()[0]
    assert "no playground" in line and "answering Host kit.test, 127.0.0.1 (KIT_ALLOWED_HOSTS);" in line
    proc, base = kit_serve(project)
    try:
        assert httpx.get(f"{base}/").headers["content-type"].startswith("text/html")
    finally:
        line = stop(proc).splitlines()[0]
    assert f"playground at {base}/" in line
    assert "answering Host localhost, 127.0.0.1, [::1] (KIT_ALLOWED_HOSTS);" in line


# ------------------------------------------------------------------ in a browser ----

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """kit-serve on the example project (agent ``chat``, durable workflow ``approval``) plus
    ``sleepy`` (naps until stopped), ``napper`` (one nap, then "rested") and ``reader`` (loads
    the release-notes skill)."""
    project = tmp_path_factory.mktemp("playground") / "project"
    shutil.copytree(HERE / ".kit", project, ignore=shutil.ignore_patterns(".state"))
    for name, (script, skills) in AGENTS.items():
        (project / "agents" / name).mkdir()
        (project / "agents" / name / "agent.py").write_text(AGENT.format(name=name, script=script,
                                                                          skills=skills))
    proc, base = kit_serve(project)
    try:
        yield types.SimpleNamespace(proc=proc, base=base)
    finally:
        stop(proc)


@pytest.fixture
def page(browser, server):
    expect.set_options(timeout=STEP)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.base}/")
    expect(page.locator("#agents button", has_text="chat")).to_be_visible()
    yield page
    page.close()
    assert errors == []  # nothing the page ran threw


def kinds(page) -> list[str]:
    return page.locator("#events li").evaluate_all("rows => rows.map(r => r.dataset.kind)")


def chat(page, agent: str, message: str) -> None:
    page.select_option("#agent", agent)
    page.fill("#message", message)
    page.press("#message", "Enter")


def test_a_message_streams_its_reply_beside_its_tool_events(page, tmp_path):
    hostile = 'what time is it? <img src=x onerror="document.title=1"><script>document.title=2</script>'
    chat(page, "chat", hostile)
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".note")).to_have_text("done")
    expect(reply.locator(".text")).to_contain_text("I checked the clock tool")
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("#events li[data-kind='run.completed']")).to_have_count(1)
    seen = kinds(page)
    assert seen[0] == "run.started" and seen[-1] == "run.completed"
    assert seen.index("tool.started") < seen.index("tool.completed") < seen.index("text.delta")
    expect(page.locator("#events li[data-kind='tool.started'] .detail")).to_have_text("current_time({})")
    expect(page.locator("#events li[data-kind='tool.completed'] .detail")).to_contain_text("current_time → 20")
    expect(page.locator("#events li[data-kind='model.completed']").first).to_contain_text("scripted:")
    assert int(page.locator("#events li[data-kind='text.delta']").get_attribute("data-count")) > 1
    expect(page.locator("#usage")).to_contain_text("out tokens")
    # Everything shown is text: the message is on the page as typed, and nothing in it ran.
    expect(page.locator(".msg.user")).to_have_text(hostile)
    expect(page.locator("#events li[data-kind='run.started'] .detail")).to_contain_text("<script>")
    assert page.locator("main img, main script").count() == 0 and page.title() == "kit playground"
    page.screenshot(path=tmp_path / "chat.png", full_page=True)


def test_the_catalog_lists_every_name_and_a_skill_load_shows_in_the_events(page, tmp_path):
    expect(page.locator("#agents li")).to_have_text(["chat", "napper", "reader", "sleepy"])
    expect(page.locator("#workflows li")).to_have_text(["approval"])
    expect(page.locator("#skills li")).to_have_text(["release-notes"])
    page.click("#agents button:text-is('reader')")
    page.fill("#message", "read the release notes skill")
    page.press("#message", "Enter")
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("#events li[data-kind='skill.loaded'] .detail")).to_contain_text("release-notes (sha256 ")
    expect(page.locator("#events li[data-kind='tool.started'] .detail")).to_have_text(
        'load_skill({"name": "release-notes"})')
    page.screenshot(path=tmp_path / "skill.png", full_page=True)


def test_a_pending_approval_is_answered_and_the_workflow_completes(page, tmp_path):
    page.click("#workflows button:text-is('approval')")
    page.fill("#wf-input", '{"title": "<b>v2</b>"}')
    page.fill("#wf-thread", "releases/v2")  # a / in a thread id: the page sends %2F
    page.click("#wf-run")
    expect(page.locator("#wf-result h3")).to_have_attribute("data-outcome", "interrupt")
    expect(page.locator("#wf-nodes [data-node='draft']")).to_contain_text("drafted '<b>v2</b>'")
    item = page.locator("#pending .pending-item[data-thread='releases/v2']")
    expect(item).to_contain_text("Publish this release?")
    expect(page.locator("#run-status")).to_have_text("waiting")
    item.locator("input").fill("yes")
    item.locator("button").click()
    expect(page.locator("#wf-result h3")).to_have_attribute("data-outcome", "done")
    output = json.loads(page.locator("#wf-result pre").inner_text())
    assert output["log"] == ["drafted '<b>v2</b>'", "answer: 'yes'", "published"]
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("#events li[data-kind='node.updated']")).to_have_count(3)
    nodes = page.locator("#wf-nodes [data-node]")
    expect(nodes).to_have_count(3)
    assert nodes.evaluate_all("boxes => boxes.map(b => b.dataset.node)") == ["draft", "approve", "publish"]
    expect(page.locator("#events li[data-kind='node.updated']").last).to_contain_text("publish →")
    expect(page.locator("#pending .pending-item[data-thread='releases/v2']")).to_have_count(0)
    assert page.locator("main b", has_text="v2").count() == 0  # the title's <b> stayed text
    page.screenshot(path=tmp_path / "approval.png", full_page=True)


def test_a_slow_run_is_cancelled(page, tmp_path):
    chat(page, "sleepy", "take a long nap")
    expect(page.locator("#events li[data-kind='tool.started']").first).to_contain_text("nap(")
    expect(page.locator("#cancel")).to_be_enabled()
    page.click("#cancel")
    expect(page.locator("#run-status")).to_have_text("cancelled")
    expect(page.locator("#events li[data-kind='control.requested']")).to_contain_text("cancel")
    expect(page.locator("#events li[data-kind='run.cancelled']")).to_have_count(1)
    expect(page.locator(".msg.assistant .note").last).to_have_text("stopped: RunStoppedError")
    expect(page.locator("#pause")).to_be_disabled()
    page.screenshot(path=tmp_path / "cancel.png", full_page=True)


def test_a_run_is_paused_and_resumed(page, tmp_path):
    chat(page, "napper", "nap once")
    expect(page.locator("#events li[data-kind='tool.started']")).to_have_count(1)
    page.click("#pause")
    expect(page.locator("#run-status")).to_have_text("paused")
    expect(page.locator("#resume")).to_be_enabled()
    page.click("#resume")
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator(".msg.assistant .text").last).to_have_text("rested")
    seen = kinds(page)
    assert seen.index("control.requested") < seen.index("run.paused") < seen.index("run.resumed")
    assert seen[-1] == "run.completed"
    page.screenshot(path=tmp_path / "pause-resume.png", full_page=True)


def test_an_enter_that_ends_an_input_method_composition_sends_nothing(page):
    """Typing Japanese, Chinese or Korean, Enter picks the input method's candidate: the keydown
    is ``isComposing`` (Chromium, Firefox) or has keyCode 229 (Safari). It sent the half-typed
    message."""
    page.select_option("#agent", "chat")
    page.fill("#message", "こんにちは")
    for init in ({"isComposing": True}, {"keyCode": 229}):
        page.locator("#message").dispatch_event("keydown", {"key": "Enter", **init})
    page.wait_for_timeout(300)
    assert page.locator("#transcript .msg").count() == 0
    assert page.input_value("#message") == "こんにちは"
    page.press("#message", "Enter")
    expect(page.locator(".msg.user")).to_have_text("こんにちは")
    expect(page.locator(".msg.assistant .note")).to_have_text("done")


def test_a_reply_that_cannot_be_picked_up_says_so(page, tmp_path):
    """The chat stream drops mid-reply and the run's log cannot be had (a server restarted
    with KIT_STORE=memory answers 404): the reply says it is lost, where it kept saying it
    was "picking the run up…"."""
    def cut(route) -> None:
        response = route.fetch()
        route.fulfill(response=response, body=response.text().split("\n\n")[0] + "\n\n")

    page.route("**/agents/*/chat?stream=true", cut)
    page.route("**/runs/*/events", lambda route: route.fulfill(
        status=404, json={"error": "UnknownRunError", "message": "no run"}))
    chat(page, "chat", "what time is it?")
    note = page.locator(".msg.assistant .note")
    expect(note).to_have_text(re.compile(r"^stream lost after seq \d+: the run could not be picked up$"))
    expect(page.locator("#notice")).to_contain_text("404 UnknownRunError")
    expect(page.locator("#send")).to_be_enabled()


def test_a_resumed_run_is_followed_live_until_it_ends(page, tmp_path):
    """``POST /runs/{id}/resume`` answers once the run ends or parks again; until then the
    panel follows the run's events, so a long run shows it goes on, and can be paused or
    cancelled (it stayed "paused", with nothing new, until the run ended)."""
    chat(page, "sleepy", "nap until stopped")
    expect(page.locator("#events li[data-kind='tool.started']").first).to_be_visible()
    page.click("#pause")
    expect(page.locator("#run-status")).to_have_text("paused")
    page.click("#resume")
    expect(page.locator("#run-status")).to_have_text("running")
    expect(page.locator("#events li[data-kind='run.resumed'] ~ li[data-kind='tool.started']").first).to_be_visible()
    expect(page.locator("#resume")).to_be_disabled()
    page.click("#cancel")
    expect(page.locator("#run-status")).to_have_text("cancelled")
    expect(page.locator("#events li[data-kind='run.cancelled']")).to_have_count(1)
    page.screenshot(path=tmp_path / "resume-live.png", full_page=True)


def test_a_dropped_event_stream_is_picked_up_with_last_event_id(page, tmp_path):
    """The first ``GET /runs/{id}/events`` is cut after three frames, as a lost connection
    would; the page asks again with Last-Event-ID and shows every event once."""
    asked: list[str | None] = []

    def cut_the_first(route) -> None:
        asked.append(route.request.headers.get("last-event-id"))
        if len(asked) > 1:
            return route.continue_()
        response = route.fetch()  # the run is short: this is its whole log
        frames = response.text().split("\n\n")
        route.fulfill(response=response, body="\n\n".join(frames[:3]) + "\n\n")

    page.route("**/runs/*/events", cut_the_first)
    chat(page, "chat", "what time is it?")
    expect(page.locator("#events-state")).to_have_text("ended")
    assert asked == [None, "2"]
    seqs = page.locator("#events li").evaluate_all("rows => rows.map(r => Number(r.dataset.seq))")
    assert seqs == sorted(set(seqs)) and seqs[:3] == [0, 1, 2]
    assert kinds(page)[-1] == "run.completed"
    page.screenshot(path=tmp_path / "reconnect.png", full_page=True)
