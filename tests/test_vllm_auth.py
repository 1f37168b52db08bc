"""A real vLLM server behind `vllm_ext.auth`: every route but the status, health and
inference ones needs the token, and TRL's GRPOTrainer trains against it.

The server is started once for the module; the tests that use it are marked slow. The
first test needs no server: TRL's own client, as `delta_sync.trainer.trl_vllm` builds it,
against a loopback HTTP server that records what each request carried.
"""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from delta_sync import DeltaSyncCallback
from delta_sync.control import API_TOKEN_ENV, TOKEN_HEADER, Route
from delta_sync.layout import anchor_path, delta_path
from delta_sync.signing import SIGNING_KEY_ENV
from delta_sync.trainer import trl_vllm

from helpers import LoopbackHTTPServer
from vllm_server import API_TOKEN, PROMPT, SIGNING_KEY, run_example, vllm_ext_auth

#: Routes of vLLM 0.32 that its OpenAPI schema leaves out: FastAPI's documentation and the
#: Prometheus app mounted at `/metrics`.
OUTSIDE_THE_SCHEMA = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc")]
OUTSIDE_THE_SCHEMA += [("GET", "/metrics")]


class RecordingVLLM(LoopbackHTTPServer):
    """Answers the three GET routes TRL's `VLLMClient` calls before generating, and records
    the headers of each request by path."""

    def __init__(self) -> None:
        self.headers: dict[str, list[dict[str, str]]] = {}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self
        answers = {
            "/health": {},
            "/v1/models": {"data": [{"id": "tiny"}]},
            "/server_info": {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}},
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = urlsplit(self.path).path
                server.headers.setdefault(path, []).append(dict(self.headers))
                body = json.dumps(answers.get(path, {"error": "no such route"})).encode()
                self.send_response(200 if path in answers else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        return Handler


def test_trls_own_client_carries_the_callbacks_token_and_headers(tmp_path, monkeypatch):
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.delenv(API_TOKEN_ENV, raising=False)
    model = torch.nn.Linear(2, 2)
    owner = DeltaSyncCallback(
        bucket=str(tmp_path / "bucket"), vllm_token="t0ken", vllm_headers={"Authorization": "Bearer hf_proxy"}
    )
    trl_vllm.claim(model, owner)
    with RecordingVLLM() as server:
        # TRL's VLLMGeneration.__init__ calls _init_vllm on itself; a stand-in with the attributes it reads.
        generation = SimpleNamespace(
            model=model,
            mode="server",
            accelerator=SimpleNamespace(is_main_process=True),
            server_base_url=server.url,
            group_port=51216,
            server_timeout=10.0,
        )
        VLLMGeneration._init_vllm(generation)
        # As GRPOTrainer does right after building the generator (a guarded route).
        config = generation.vllm_client.get_server_info()
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    (sent,) = server.headers["/server_info"]
    assert sent[TOKEN_HEADER] == "t0ken" and sent["Authorization"] == "Bearer hf_proxy"
    # The constructor's calls go out before the headers are set: the middleware leaves both open.
    assert {"/health", "/v1/models", "/server_info"} == set(server.headers)
    assert ("GET", "/health") in vllm_ext_auth().STATUS_ROUTES
    assert ("GET", "/v1/models") in vllm_ext_auth().STATUS_ROUTES


def test_vllm_034s_routes_are_classified_and_its_checkpoint_routes_need_the_token():
    """vLLM 0.34 moved the fault-tolerance status under `/v1` and added `/v1/decisions` and
    `/checkpoint/{prepare,restore,status}`: a status probe of a guarded 0.34 server needs no
    token, preparing or restoring a checkpoint (which drains the engine) does."""
    import asyncio

    auth = vllm_ext_auth()
    reached = []

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guarded = auth.WeightRouteAuthMiddleware(app, token="t0ken")

    async def status(method: str, path: str) -> int:
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return (await client.request(method, path)).status_code

    expected = {
        ("GET", "/v1/fault_tolerance/status"): ("status", 200),
        ("GET", "/fault_tolerance/status"): ("status", 200),  # 0.32
        ("GET", "/checkpoint/status"): ("status", 200),
        ("POST", "/v1/decisions"): ("inference", 200),
        ("POST", "/checkpoint/prepare"): ("guarded", 401),
        ("POST", "/checkpoint/restore"): ("guarded", 401),
        ("POST", "/v1/fault_tolerance/apply"): ("guarded", 401),
    }
    for (method, path), (kind, code) in expected.items():
        assert auth.route_class(method, path) == kind, path
        assert asyncio.run(status(method, path)) == code, path
    assert auth.route_class("POST", "/a_route_of_a_later_vllm") is None  # guarded, and noticed
    # The three lists never disagree: a guarded route is neither a status nor an inference one.
    assert not auth.GUARDED_ROUTES & auth.STATUS_ROUTES
    assert not {path for _, path in auth.GUARDED_ROUTES} & auth.INFERENCE_ROUTES


# -- against a real server ------------------------------------------------------------------


def server_routes(server) -> set[tuple[str, str]]:
    """(method, path template) of every route the running server serves."""
    schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30)
    schema.raise_for_status()
    routes = {
        (method.upper(), path)
        for path, operations in schema.json()["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "patch", "delete")
    }
    return routes | set(OUTSIDE_THE_SCHEMA)


@pytest.mark.slow
def test_every_route_of_the_server_but_the_open_ones_needs_the_token(guarded_server):
    auth = vllm_ext_auth()
    routes = server_routes(guarded_server)
    assert {("POST", "/update_weights"), ("POST", "/collective_rpc"), ("GET", "/server_info")} <= routes
    assert {("POST", "/v1/completions"), ("GET", "/health")} <= routes
    open_routes, refused = set(), set()
    for method, template in sorted(routes):
        path = re.sub(r"\{\w+\}", "x", template)
        # No token: the middleware answers for a guarded route, vLLM for an open one (a
        # request with no body changes nothing there: it is refused as invalid).
        response = httpx.request(method, f"{guarded_server.url}{path}", timeout=60)
        if response.status_code == 401 and "needs the server's token" in response.text:
            refused.add((method, template))
        else:
            open_routes.add((method, template))
    allowed = set(auth.STATUS_ROUTES) | {(method, t) for method, t in routes if t in auth.INFERENCE_ROUTES}
    assert not open_routes - allowed, f"open without the token: {sorted(open_routes - allowed)}"
    # Everything the allow list names that the server serves is open, the rest refused.
    assert open_routes == allowed & routes and refused == routes - allowed
    assert ("POST", "/update_weights") in refused and ("GET", "/server_info") in refused


@pytest.mark.slow
def test_weight_routes_refuse_requests_without_the_token(guarded_server, trainer):
    trainer.step()
    trainer.step()
    assert guarded_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    held = guarded_server.status()
    completion = guarded_server.greedy(PROMPT)
    # Each route with a body that would change the server if it were accepted.
    bodies = {
        Route.UPDATE: {"json": {"update_info": {"bucket": trainer.bucket, "filename": delta_path(2)}}},
        Route.COLLECTIVE_RPC: {"json": {"method": "reset_weights"}},
        "/weight_checker": {"json": {"action": "reset"}},
        Route.PAUSE: {"params": {"mode": "abort"}},
    }
    routes = {value for name, value in vars(Route).items() if name.isupper()} | set(bodies)
    for route in sorted(routes | {"/init_weight_transfer_engine", "/update_weight_version", "/sleep"}):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {TOKEN_HEADER: "wrong"}):
            response = guarded_server.post(route, headers=headers, **bodies.get(route, {}))
            assert response.status_code == 401, (route, headers, response.text)
    assert guarded_server.status() == held
    is_paused = httpx.get(f"{guarded_server.url}/is_paused", timeout=30).json()
    assert is_paused == {"is_paused": False}
    # Completions are vLLM's own business (--api-key): no token needed, same weights served.
    response = guarded_server.post(
        "/v1/completions",
        headers={},
        json={"model": str(guarded_server.model_dir), "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0},
    )
    assert response.status_code == 200, response.text
    assert guarded_server.greedy(PROMPT) == completion
    # With the token the same update goes through.
    assert guarded_server.update(trainer.bucket, delta_path(2)).status_code == 200
    assert guarded_server.status()["model_checksum"] == trainer.checksum()


@pytest.mark.slow
def test_grpo_trainer_trains_against_a_token_guarded_server(guarded_server, bucket_root, monkeypatch, tmp_path):
    """The main example with --vllm-url and the token in the trainer's environment: a real
    GRPOTrainer(use_vllm=True, vllm_mode="server"), whose TRL client reads the guarded
    `/server_info` and generates, while the callback pushes every version."""
    monkeypatch.setenv(API_TOKEN_ENV, API_TOKEN)
    # The server applies only signed versions: the example signs with the key it trusts.
    private, _ = SIGNING_KEY.save(tmp_path / "keys")
    monkeypatch.setenv(SIGNING_KEY_ENV, str(private))
    log_before = len(guarded_server.log_tail(10**9))
    output = run_example(guarded_server, bucket_root / "grpo-guarded", "--steps", "3", "--anchor-every", "2")
    assert re.search(r"vLLM server checks\s+3\n", output), output[-3000:]
    assert re.search(r"vLLM server bit-exact\s+yes", output), output[-3000:]
    server_log = guarded_server.log_tail(10**9)[log_before:]
    assert re.search(r'"GET /server_info\?config_format=json HTTP/1\.1" 200', server_log), server_log[-3000:]
    assert server_log.count("POST /v1/completions") >= 3
    assert not re.search(r'HTTP/1\.1" 40[13]', server_log), server_log[-3000:]  # no request was refused
    assert guarded_server.status()["version"] == 3
