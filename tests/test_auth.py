"""`vllm_ext.auth`: the token on the weight-update and RPC routes, on a tiny ASGI app.

The middleware is plain ASGI and imports nothing from vLLM; this environment has no vLLM
(which `vllm_ext/__init__` imports), so the module is loaded from its file. The same class
guards a real server in `test_vllm.py`.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from vllm_server import vllm_ext_auth

TOKEN = "s3cret-token"

auth = vllm_ext_auth()


class Recorder:
    """An ASGI app that answers 200 and records what reached it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            self.calls.append((scope["type"], scope.get("path")))
            return
        self.calls.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def request(app, method: str, path: str, headers: dict[str, str] | None = None, root_path: str = "") -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.request(method, path, headers=headers)

    return asyncio.run(send())


@pytest.fixture
def inner():
    return Recorder()


@pytest.fixture
def guarded(inner):
    return auth.WeightRouteAuthMiddleware(inner, token=TOKEN)


@pytest.mark.parametrize("route", sorted(auth.GUARDED_ROUTES))
def test_every_guarded_route_needs_the_token(guarded, inner, route):
    for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {auth.TOKEN_HEADER: "wrong"}]:
        response = request(guarded, "POST", route, headers)
        assert response.status_code == 401, (route, headers)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert "token" in response.json()["error"]
    assert inner.calls == []  # nothing reached the server
    assert request(guarded, "POST", route, {"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert request(guarded, "POST", route, {auth.TOKEN_HEADER: TOKEN}).status_code == 200
    assert inner.calls == [("POST", route), ("POST", route)]


def test_the_dedicated_header_passes_a_proxy_that_takes_authorization(guarded, inner):
    # A private Space: Authorization carries the Hub token for the proxy, the header ours.
    headers = {"Authorization": "Bearer hf_xxx", auth.TOKEN_HEADER: TOKEN}
    assert request(guarded, "POST", "/update_weights", headers).status_code == 200
    assert request(guarded, "POST", "/update_weights", {"authorization": f"bearer  {TOKEN} "}).status_code == 200


@pytest.mark.parametrize("path", ["/pause/", "/PAUSE", "/Collective_RPC/", "/fault_tolerance/apply/"])
def test_variants_of_a_guarded_path_are_guarded(guarded, inner, path):
    assert request(guarded, "POST", path).status_code == 401
    assert inner.calls == []


def test_a_root_path_prefix_is_seen_through(guarded, inner):
    assert request(guarded, "POST", "/api/pause", root_path="/api").status_code == 401
    assert (
        request(guarded, "POST", "/api/pause", {"Authorization": f"Bearer {TOKEN}"}, root_path="/api").status_code
        == 200
    )


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/v1/completions"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/is_paused"),
        ("OPTIONS", "/pause"),
    ],
)
def test_other_routes_are_left_to_vllm(guarded, inner, method, path):
    assert request(guarded, method, path).status_code == 200
    assert inner.calls == [(method, path)]


def test_without_a_token_the_routes_are_closed(monkeypatch, inner, caplog):
    monkeypatch.delenv(auth.API_TOKEN_ENV, raising=False)
    with caplog.at_level(logging.ERROR, logger="delta_sync"):
        app = auth.WeightRouteAuthMiddleware(inner)
    assert f"{auth.API_TOKEN_ENV} is not set" in caplog.text
    for headers in [None, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}]:
        response = request(app, "POST", "/update_weights", headers)
        assert response.status_code == 403 and auth.API_TOKEN_ENV in response.json()["error"]
    assert request(app, "POST", "/v1/completions").status_code == 200
    assert inner.calls == [("POST", "/v1/completions")]
    monkeypatch.setenv(auth.API_TOKEN_ENV, "  ")  # blank is no token
    assert request(auth.WeightRouteAuthMiddleware(inner), "POST", "/pause").status_code == 403


def test_the_token_comes_from_the_environment(monkeypatch, inner):
    monkeypatch.setenv(auth.API_TOKEN_ENV, TOKEN)
    app = auth.WeightRouteAuthMiddleware(inner)  # as vLLM builds it: no arguments
    assert request(app, "POST", "/pause").status_code == 401
    assert request(app, "POST", "/pause", {"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_websockets_and_lifespan(guarded, inner):
    async def run() -> list[dict]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "websocket.connect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await guarded({"type": "websocket", "path": "/collective_rpc", "headers": []}, receive, send)
        await guarded({"type": "lifespan"}, receive, send)  # passes through untouched
        return sent

    sent = asyncio.run(run())
    assert [(m["type"], m.get("code")) for m in sent] == [("websocket.close", 1008)]
    assert inner.calls == [("lifespan", None)]
