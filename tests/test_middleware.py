"""API keys and the body size limit, in front of a plain echo app (the logic alone)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from confkv.server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware, JSONBodyMiddleware


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


def client(**limits) -> TestClient:
    routes = [Route(path, echo, methods=["GET", "POST"]) for path in ("/generate", "/health", "/metrics", "/v1/models")]
    app = APIKeyMiddleware(Starlette(routes=routes), keys=["k1", "k2"], open_paths={"/health"})
    return TestClient(JSONBodyMiddleware(BodySizeLimitMiddleware(app, max_bytes=limits.get("max_bytes", 100))))


def test_every_route_but_health_needs_a_valid_key():
    c = client()
    assert c.get("/health").status_code == 200
    for path in ("/generate", "/metrics", "/v1/models"):
        r = c.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.get("/generate", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/generate", headers={"Authorization": "Basic k1"}).status_code == 401
    assert c.get("/generate", headers={"Authorization": "Bearer k2"}).status_code == 200
    ours, openai = c.get("/generate").json(), c.get("/v1/models").json()
    assert ours["error"]["type"] == "unauthorized" and "Bearer" in ours["error"]["message"]
    assert openai["error"]["type"] == "authentication_error" and openai["error"]["code"] == "unauthorized"


def test_bodies_over_the_limit_get_413_with_or_without_a_length():
    c = client()
    auth = {"Authorization": "Bearer k1"}
    assert c.post("/generate", content=b"x" * 100, headers=auth).json() == {"size": 100}
    r = c.post("/generate", content=b"x" * 101, headers=auth)
    assert r.status_code == 413 and "100 bytes" in r.json()["error"]["message"]

    def chunks(n: int):
        for _ in range(n):
            yield b"x" * 30

    assert c.post("/generate", content=chunks(3), headers=auth).json() == {"size": 90}
    assert c.post("/generate", content=chunks(4), headers=auth).status_code == 413


def test_bodies_that_are_not_json_get_415():
    c = client()
    auth = {"Authorization": "Bearer k1"}
    r = c.post("/generate", content=b"hi", headers={**auth, "Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    openai = c.post("/v1/models", content=b"{}", headers={**auth, "Content-Type": "text/xml"})
    assert openai.json()["error"]["code"] == "unsupported_media_type"
    for declared in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        assert c.post("/generate", content=b"{}", headers={**auth, "Content-Type": declared}).status_code == 200
    assert c.get("/generate", headers={**auth, "Content-Type": "text/plain"}).status_code == 200  # no body to judge
