"""`vllm_ext.auth`: the token on every route but the status, health and inference ones, on a
tiny ASGI app.

The middleware is plain ASGI and imports nothing from vLLM; this environment has no vLLM
(which `vllm_ext/__init__` imports), so the module is loaded from its file. The same class
guards a real server in `test_vllm_auth.py`, which lists that server's routes.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from delta_sync.control import Route

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


#: vLLM 0.32 routes that change weights, generation, caches or memory, call into the workers,
#: reveal the configuration, or serve inference outside `--api-key`'s prefixes; and one that
#: a later vLLM might add. None is open.
GUARDED = [
    ("POST", route)
    for route in (
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_checker",
        "/pause",
        "/resume",
        "/abort_requests",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/fault_tolerance/apply",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/tokenize",
        "/detokenize",
        "/invocations",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/generative_scoring",
        "/health",  # open to GET only
        "/a_route_of_a_later_vllm",
    )
] + [
    ("GET", route)
    for route in ("/server_info", "/tokenizer_info", "/kv_event_sources", "/openapi.json", "/docs", "/metrics/x")
]


def open_requests() -> list[tuple[str, str]]:
    """A request to each open route: the status routes, and the inference routes with a
    path parameter filled in."""
    inference = [("POST", route.replace("{response_id}", "resp_1")) for route in sorted(auth.INFERENCE_ROUTES)]
    return sorted(auth.STATUS_ROUTES) + inference


@pytest.mark.parametrize("method,route", GUARDED)
def test_every_other_route_needs_the_token(guarded, inner, method, route):
    for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {auth.TOKEN_HEADER: "wrong"}]:
        response = request(guarded, method, route, headers)
        assert response.status_code == 401, (route, headers)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert "token" in response.json()["error"]
    assert inner.calls == []  # nothing reached the server
    assert request(guarded, method, route, {"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert request(guarded, method, route, {auth.TOKEN_HEADER: TOKEN}).status_code == 200
    assert inner.calls == [(method, route), (method, route)]


def test_the_open_routes_are_status_and_inference_routes_only():
    # What vLLM's --api-key guards, and nothing of the weight-update protocol.
    assert all(route.startswith(auth.API_KEY_PREFIXES) for route in auth.INFERENCE_ROUTES)
    assert all(method in ("GET", "POST") for method, _ in auth.STATUS_ROUTES)
    open_paths = {path for _, path in auth.STATUS_ROUTES} | auth.INFERENCE_ROUTES
    control = {value for name, value in vars(Route).items() if name.isupper()}
    assert control and not control & open_paths
    assert not {route for _, route in GUARDED} & auth.INFERENCE_ROUTES


@pytest.mark.parametrize("method,route", open_requests())
def test_status_and_inference_routes_are_left_to_vllm(guarded, inner, method, route):
    assert request(guarded, method, route).status_code == 200
    assert inner.calls == [(method, route)]


@pytest.mark.parametrize(
    "method,path,headers,is_open",
    [
        ("HEAD", "/health", None, True),  # answered as GET
        ("GET", "/v1/responses/resp_1/cancel", None, True),
        ("GET", "/v1/responses/a/b", None, False),  # a parameter is one segment
        ("GET", "/v1/models/", None, False),  # another path for the router
        ("GET", "/V1/MODELS", None, False),
        ("OPTIONS", "/pause", {"Origin": "https://x", "Access-Control-Request-Method": "POST"}, True),
        ("OPTIONS", "/pause", None, False),  # not a preflight, which vLLM's CORS layer would answer
    ],
)
def test_what_is_open_is_matched_as_the_router_sees_it(guarded, inner, method, path, headers, is_open):
    response = request(guarded, method, path, headers)
    assert (response.status_code == 200) is is_open, (method, path, response.status_code)
    assert inner.calls == ([(method, path)] if is_open else [])


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
        await guarded({"type": "websocket", "path": "/v1/realtime", "headers": []}, receive, send)  # inference
        await guarded({"type": "lifespan"}, receive, send)  # passes through untouched
        return sent

    sent = asyncio.run(run())
    assert [(m["type"], m.get("code")) for m in sent] == [("websocket.close", 1008)]
    assert inner.calls == [("websocket", "/v1/realtime"), ("lifespan", None)]
