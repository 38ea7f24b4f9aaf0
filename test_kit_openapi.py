"""Tests of ``GET /openapi.json`` (kit_openapi): the document and kit_http's route table are
one list, an OpenAPI validator accepts the document, and schemathesis, driven from the live
document against a real kit-serve on the example project, finds no 5xx and no response that
breaks it."""
from __future__ import annotations

import gzip
import json
from urllib.parse import urljoin

import anyio
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from openapi_spec_validator import validate

import kit_http
import kit_request
from kit_openapi import OPERATIONS, document
from test_kit_http import HERE, Scripted, catalog, http_scope, served
from test_kit_serve import kit_serve, stop

#: Test cases per operation and phase: enough to reach every route's runs, refusals and
#: streams (~600 requests), little enough for CI (~15 s).
EXAMPLES = 30
#: Fixed, so a failure reproduces (schemathesis prints the seed and `st replay` ids).
SEED = 15
#: A durable workflow refuses a run without a thread id (400), which a body schema shared by
#: every workflow cannot say; schemathesis is told so for that operation only.
CONFIG = '''
[[operations]]
include-path = "/workflows/{name}"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "409"]
'''


def test_the_document_describes_exactly_the_route_table():
    table = {(method, path) for method, path, *_ in kit_http._ROUTES}
    assert set(OPERATIONS) == table
    with pytest.raises(KeyError):
        document([("GET", "/undocumented")])


def test_every_route_that_reads_a_body_documents_how_a_body_is_refused():
    """A body is refused before its route sees it: malformed (400), stalled (408), too large
    (413), not JSON (415); the document says so with the limits kit_request enforces."""
    doc = document(list(OPERATIONS))
    for (method, path), op in OPERATIONS.items():
        # Every POST reads a body, so documents it (POST /mcp did not: a client built from the
        # document sent none, and got the JSON-RPC parse error).
        assert ("requestBody" in op) is (method == "POST"), (method, path)
        if "requestBody" in op:
            assert {"400", "408", "413", "415"} <= set(op["responses"]), (method, path)
    described = {code: r["description"] for code, r in doc["components"]["responses"].items()}
    assert f"{kit_request.BODY_TIMEOUT:g} s" in described["408"]
    assert f"{kit_request.MAX_BODY_BYTES // 2**20} MiB" in described["413"]


SURFACE_OPS = {("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
               ("GET", "/v1/models/{model}"), ("POST", "/mcp"), ("GET", "/mcp")}


@pytest.mark.anyio
@pytest.mark.parametrize("options, dropped", [
    ({}, {("POST", "/v2/invocables/{name}/chat"), *SURFACE_OPS}),
    ({"native": True, "playground": False}, {("GET", "/"), *SURFACE_OPS}),
    ({"surfaces": ("openai",)}, {("POST", "/v2/invocables/{name}/chat"), *SURFACE_OPS} - {
        ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/{model}")})])
async def test_an_app_documents_the_routes_it_serves_and_a_validator_accepts_it(options, dropped):
    async with served(catalog(), **options) as (client, _):
        r = await client.get("/openapi.json")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        doc = r.json()
        validate(doc)  # raises OpenAPIValidationError
        assert doc["openapi"] == "3.1.0"
        served_ops = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
        gets = {p for m, p in set(OPERATIONS) - dropped if m == "GET"}
        assert served_ops == set(OPERATIONS) - dropped | {  # HEAD: a GET but a stream's
            ("HEAD", p) for p in gets - {"/runs/{run_id}/events", "/mcp"}}
        # Both ways: a documented operation reaches its handler (no 404 for the route, no
        # 405), and a method the document leaves out of a path is a 405 there.
        for path in doc["paths"]:
            url = path.replace("{name}", "echo").replace("{thread_id}", "t").replace("{run_id}", "r")
            for method in ("GET", "HEAD", "POST", "PUT", "DELETE"):
                r = await client.request(method, url, json={"message": "hi"} if method == "POST" else None)
                assert (r.status_code != 405) is ((method, path) in served_ops), (method, path)
                if r.status_code == 404 and method != "HEAD":
                    assert r.json()["error"] != "RouteNotFoundError", (method, path)
                if method == "HEAD" and r.status_code != 405:  # the GET's status and headers
                    got = await client.get(url)
                    assert (r.status_code, r.content) == (got.status_code, b""), path
                    assert r.headers["content-type"] == got.headers["content-type"], path
                    assert str(r.status_code) in doc["paths"][path]["head"]["responses"], path
        name = {p["name"]: p for p in doc["paths"]["/agents/{name}/chat"]["post"]["parameters"]}["name"]
        assert name["schema"] == {"enum": ["echo"]}
        frames = doc["paths"]["/agents/{name}/chat"]["post"]["responses"]["200"]["content"]
        assert set(frames) == {"application/json", "text/event-stream"}
        assert "event: done" in doc["paths"]["/agents/{name}/chat"]["post"]["description"]
        # Every route that answers ?stream=true with SSE documents the parameter and the stream.
        for path in ("/agents/{name}/chat", "/workflows/{name}", "/workflows/{name}/{thread_id}/resume",
                     "/runs/{run_id}/resume"):
            op = doc["paths"][path]["post"]
            assert "stream" in {p["name"] for p in op["parameters"]}, path
            assert "text/event-stream" in op["responses"]["200"]["content"], path
        r = await client.post("/workflows/approve?stream=true", json={"thread_id": "t"})
        assert r.headers["content-type"] == "text/event-stream"
        r = await client.post("/workflows/approve/t/resume?stream=true", json={"value": "yes"})
        assert r.headers["content-type"] == "text/event-stream" and b"event: done" in r.content
        # Request bodies are as closed as kit reads them: an unknown key is a 400 naming it.
        schemas = doc["components"]["schemas"]
        assert schemas["ChatRequest"]["additionalProperties"] is False
        assert schemas["ResumeRequest"]["required"] == ["value"]
        if ("POST", "/v1/chat/completions") in served_ops:  # its errors are OpenAI's shape
            op = doc["paths"]["/v1/chat/completions"]["post"]
            assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/OpenAIError"}
            r = await client.post("/v1/chat/completions", json={"model": "echo", "messages": []})
            assert r.status_code == 400
            jsonschema.validate(r.json(), schemas["OpenAIError"])
            # So are the guard's refusals there, which come before any route: as documented.
            for method, path, headers in [("post", "/v1/chat/completions", {"host": "rebound.example"}),
                                          ("get", "/v1/models", {"host": "rebound.example"}),
                                          ("get", "/v1/models", {"origin": "https://evil.example"})]:
                r = await client.request(method, path, headers=headers)
                response = doc["paths"][path][method]["responses"][str(r.status_code)]
                if "$ref" in response:
                    response = doc["components"]["responses"][response["$ref"].rpartition("/")[2]]
                schema = response["content"]["application/json"]["schema"]
                jsonschema.validate(r.json(), {**schema, "components": doc["components"]})


@pytest.mark.anyio
async def test_every_refusal_before_a_handler_is_documented_on_every_route_it_reaches():
    """kit_http refuses some requests before their handler, on every route alike: a path
    parameter that is not UTF-8 once percent-decoded (400), a gzip body (415). Each operation
    documents what it answers (GET /v1/models/{model} and POST /mcp did not)."""
    async with served(catalog(), native=True, surfaces=("openai", "mcp")) as (client, _):
        doc = (await client.get("/openapi.json")).json()
        seen = []
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                url = re.sub(r"\{\w+\}", "%FF", path)
                tries = [("path", url, {})] if url != path else []
                if method == "post":
                    tries.append(("gzip", path.replace("{", "").replace("}", ""), {
                        "content": gzip.compress(b"{}"),
                        "headers": {"content-type": "application/json", "content-encoding": "gzip",
                                    "accept": "application/json, text/event-stream"}}))
                for what, target, kw in tries:
                    r = await client.request(method, target, **kw)
                    seen.append((method, path, what, r.status_code))
                    assert str(r.status_code) in op["responses"], (method, path, what, r.status_code)
        assert ("get", "/v1/models/{model}", "path", 400) in seen
        assert ("post", "/mcp", "gzip", 415) in seen


@pytest.mark.anyio
async def test_a_mounted_app_documents_its_mount_as_the_server_its_paths_are_below():
    """Mounted at /kit, the document listed no server: a client resolves its paths against the
    host's root (OpenAPI's default server is "/"), so Swagger UI's /health missed the mount."""
    app = kit_http.App(catalog())
    life = Scripted({"type": "lifespan.startup"})
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}}, life.receive, life.send)
            while not life.sent:
                await anyio.sleep(0.01)
            for root, servers in (("/kit", [{"url": "/kit"}]), ("", None), ("/my kit", [{"url": "/my%20kit"}]),
                                  ("/kit", [{"url": "/kit"}])):
                got = Scripted({"type": "http.request", "body": b""})
                await app(http_scope("GET", f"{root}/openapi.json", root_path=root), got.receive, got.send)
                doc = json.loads(got.sent[1]["body"])
                assert [{"url": s["url"]} for s in doc.get("servers", [])] == (servers or []), root
                url = urljoin("http://127.0.0.1/", (servers or [{"url": ""}])[0]["url"] + "/health")
                health = Scripted({"type": "http.request", "body": b""})  # where a client sends it
                await app(http_scope("GET", url[len("http://127.0.0.1"):].replace("%20", " "),
                                     root_path=root), health.receive, health.send)
                assert health.sent[0]["status"] == 200, url
            life.push({"type": "lifespan.shutdown"})


def test_schemathesis_finds_no_5xx_and_no_response_that_breaks_the_document(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(HERE / ".kit", project, ignore=shutil.ignore_patterns(".state"))
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    report, har = tmp_path / "report.json", tmp_path / "requests.har"
    st = Path(sys.executable).with_name("schemathesis")
    proc, base = kit_serve(project)
    try:
        out = subprocess.run(
            [str(st), "--config-file", str(tmp_path / "schemathesis.toml"), "run",
             f"{base}/openapi.json", "--checks", "all",
             "--exclude-checks", "ignored_auth,object_level_authorization",  # kit has no auth
             "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--workers", "1",
             "--generation-database", "none", "--no-color", "--report", "json,har",
             "--report-json-path", str(report), "--report-har-path", str(har)],
            cwd=tmp_path, capture_output=True, text=True, timeout=240)
    finally:
        stop(proc)
    summary = json.loads(report.read_text())
    statuses = Counter(e["response"]["status"] for e in json.loads(har.read_text())["log"]["entries"])
    print(f"schemathesis: {summary['test_cases']['generated']} test cases, "
          f"{sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert out.returncode == 0, out.stdout[-6000:]
    assert summary["failures"] == [] and summary["errors"] == []
    # Every operation kit-serve serves but the native one, the surfaces and the document's own
    # URL; and HEAD on each GET but the stream's (/, /openapi.json, /health, /workflows/pending).
    heads = {p for m, p in OPERATIONS if m == "GET"} - {p for _, p in SURFACE_OPS} - {"/runs/{run_id}/events"}
    assert summary["operations"]["tested"] == summary["operations"]["total"] == (
        len(OPERATIONS) - 2 - len(SURFACE_OPS) + len(heads))
    assert not [s for s in statuses if s >= 500]
    assert summary["test_cases"]["generated"] >= 200 and statuses[200] > 0
