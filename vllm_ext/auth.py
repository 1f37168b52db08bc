"""A bearer token on every route of a vLLM server but its status, health and inference routes.

With `VLLM_SERVER_DEV_MODE=1`, vLLM opens routes that load weights, pause generation and
call any worker method (`/update_weights`, `/collective_rpc`, ...), and its own `--api-key`
guards only `/v1`, `/v2`, `/inference` and `/cohere`. Install this middleware with vLLM's
`--middleware` option and set the token in the server's environment:

```bash
export DELTA_SYNC_API_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(32))")
VLLM_SERVER_DEV_MODE=1 DELTA_SYNC_ALLOWED_BUCKETS=file:///data/deltas vllm serve MODEL \\
    --middleware vllm_ext.auth.WeightRouteAuthMiddleware \\
    --worker-extension-cls vllm_ext.DeltaWorkerExtension \\
    --weight-transfer-config '{"backend": "delta"}'
```

The middleware closes by default: a request must carry the token, as
`Authorization: Bearer <token>` or as `X-Delta-Sync-Token: <token>` (for servers behind a
proxy that takes `Authorization` for itself, such as a private Hugging Face Space), unless
it is one of

* [`STATUS_ROUTES`]: read-only status and health routes (`GET /health`, `GET /v1/models`,
  `GET /is_paused`, ...), open to anyone who reaches the server;
* [`INFERENCE_ROUTES`]: vLLM's inference routes, all under the prefixes its `--api-key`
  guards (`/v1/completions`, `/v1/chat/completions`, ...), left to that key.

So a route a later vLLM adds is guarded until it is listed here; so are vLLM's routes that
serve inference outside those prefixes (`/tokenize`, `/invocations`, `/pooling`, ...),
which `--api-key` would leave open, and `/v1/load_lora_adapter`, which changes weights.

The middleware fails closed: installed without a token in the environment, it refuses
every guarded route (HTTP 403) and says so in the server log at start.

This module is plain ASGI and imports nothing from vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, ClassVar

# Defined once, in the control-plane contract both sides import.
from delta_sync.control import API_TOKEN_ENV, TOKEN_HEADER

__all__ = [
    "API_TOKEN_ENV",
    "GUARDED_ROUTES",
    "INFERENCE_ROUTES",
    "STATUS_ROUTES",
    "TOKEN_HEADER",
    "WeightRouteAuthMiddleware",
    "route_class",
]

logger = logging.getLogger("delta_sync")


#: vLLM's read-only status and health routes (0.32 through 0.34), as (method, path): they
#: change nothing and reveal no configuration. TRL's `VLLMClient` calls `/health` and
#: `/v1/models` before it can carry a token; orchestrators poll `/checkpoint/status`.
#: `HEAD` is answered as `GET`.
STATUS_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/ping"),  # SageMaker's health check, both methods
        ("POST", "/ping"),
        ("GET", "/version"),
        ("GET", "/load"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/is_paused"),
        ("GET", "/is_sleeping"),
        ("GET", "/weight_info"),
        ("GET", "/get_world_size"),
        ("POST", "/is_scaling_elastic_ep"),  # a question, though posted
        ("GET", "/fault_tolerance/status"),  # 0.32
        ("GET", "/v1/fault_tolerance/status"),  # 0.34
        ("GET", "/checkpoint/status"),  # 0.34
        ("GET", "/ready"),  # the data-parallel supervisor's probes
        ("GET", "/readyz"),
    }
)

#: vLLM's inference routes (0.32 through 0.34), any method, all under `/v1`, `/v2`, `/inference` or
#: `/cohere`, which vLLM's own `--api-key` guards (`{name}` is one path segment). What
#: changes weights under those prefixes (`/v1/load_lora_adapter`, ...) is not listed.
INFERENCE_ROUTES: frozenset[str] = frozenset(
    {
        "/v1/completions",
        "/v1/completions/render",
        "/v1/completions/derender",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/responses",
        "/v1/responses/render",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/render",
        "/v1/systemone",
        "/v1/decisions",  # 0.34
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/v2/rerank",
        "/v2/embed",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/realtime",  # a websocket
        "/inference/v1/generate",
        "/inference/v1/abort_requests",
        "/cohere/v2/chat",
        "/cohere/v2/chat/render",
    }
)

#: vLLM's routes (0.32 through 0.34) that need the token, as (method, path): they change
#: weights, pause or steer the engine, call worker methods, reveal the configuration, or
#: serve inference outside the prefixes `--api-key` guards. The middleware guards every route
#: not open, listed here or not; the list says which routes were looked at, so that a route
#: a new vLLM adds is noticed (`route_class` answers None for it).
GUARDED_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        # weights and the update session
        ("POST", "/init_weight_transfer_engine"),
        ("POST", "/shutdown_weight_transfer_engine"),
        ("POST", "/start_weight_update"),
        ("POST", "/start_draft_weight_update"),  # 0.34
        ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"),
        ("POST", "/update_weight_version"),
        ("POST", "/weight_checker"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/collective_rpc"),
        # the engine's state
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("POST", "/release_kv_cache_memory"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/reset_mm_cache"),
        ("POST", "/reset_encoder_cache"),
        ("POST", "/abort_requests"),
        ("POST", "/scale_elastic_ep"),
        ("POST", "/fault_tolerance/apply"),  # 0.32
        ("POST", "/v1/fault_tolerance/apply"),  # 0.34
        ("POST", "/checkpoint/prepare"),  # 0.34: drains the engine and releases its memory
        ("POST", "/checkpoint/restore"),  # 0.34
        ("POST", "/start_profile"),
        ("POST", "/stop_profile"),
        # the configuration
        ("GET", "/server_info"),
        ("GET", "/kv_event_sources"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/redoc"),
        # inference outside the prefixes --api-key guards
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/tokenizer_info"),
        ("POST", "/invocations"),
        ("POST", "/pooling"),
        ("POST", "/classify"),
        ("POST", "/score"),
        ("POST", "/rerank"),
        ("POST", "/generative_scoring"),
    }
)

#: The prefixes vLLM's `--api-key` guards (`vllm/entrypoints/serve/middleware/authenticate.py`).
API_KEY_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class WeightRouteAuthMiddleware:
    """ASGI middleware requiring a token on every route but [`STATUS_ROUTES`] and [`INFERENCE_ROUTES`].

    vLLM builds it with no arguments (`--middleware vllm_ext.auth.WeightRouteAuthMiddleware`),
    so the token comes from `$DELTA_SYNC_API_TOKEN`. Tokens are compared in constant time.
    A route is matched as vLLM's router sees it (the path below the server's root path,
    exactly: a trailing slash or another case is another, guarded, path).

    Answers: 401 when the token is missing or wrong, 403 when the server has no token set
    (nothing could pass). Neither reaches vLLM, so a refused request changes nothing.

    Args:
        app: The ASGI application to guard.
        token: The token; None reads `$DELTA_SYNC_API_TOKEN`. Empty means none.

    Example:
        ```python
        >>> app = WeightRouteAuthMiddleware(app, token="s3cret")
        >>> httpx.post(f"{url}/pause", headers={"Authorization": "Bearer s3cret"})
        ```
    """

    #: (method, path) pairs open without the token; a subclass may change them.
    status_routes: ClassVar[frozenset[tuple[str, str]]] = STATUS_ROUTES
    #: Path templates open without the token, any method (left to `--api-key`).
    inference_routes: ClassVar[frozenset[str]] = INFERENCE_ROUTES

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        self._inference = _templates_pattern(self.inference_routes)
        token = os.environ.get(API_TOKEN_ENV, "") if token is None else token
        # Digests have one length whatever the token's: the comparison leaks neither.
        self._digest = _digest(token.strip().encode()) if token.strip() else None
        if self._digest is None:
            logger.error(
                "delta-sync: %s is not set: every route of this server but its status, health and inference "
                "routes is closed (refused with 403), the weight-update and RPC routes among them",
                API_TOKEN_ENV,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self.is_open(scope):
            refusal = self._refusal(scope)
            if refusal is not None:
                logger.warning("delta-sync: refused %s %s: %s", scope.get("method", "WS"), scope["path"], refusal[1])
                await _refuse(scope, send, *refusal)
                return
        await self.app(scope, receive, send)

    def is_open(self, scope: Scope) -> bool:
        """Whether a request may reach vLLM without the token.

        Args:
            scope: The ASGI scope of an `http` or `websocket` request.
        """
        if scope["type"] == "websocket":
            method = "WEBSOCKET"
        else:
            method = str(scope.get("method", "")).upper()
            if method == "OPTIONS" and _is_cors_preflight(scope):
                return True  # vLLM's CORS middleware answers it without calling any route
            if method == "HEAD":
                method = "GET"
        path = _route_path(scope)
        return (method, path) in self.status_routes or self._inference.fullmatch(path) is not None

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request may not pass, else None."""
        if self._digest is None:
            return 403, (
                f"this server has no {API_TOKEN_ENV} set, so every route but its status, health and "
                "inference routes is closed"
            )
        presented = _presented_tokens(scope)
        if not presented:
            return 401, (
                f"this route needs the server's token (Authorization: Bearer <token>, or {TOKEN_HEADER}); "
                "only the status, health and inference routes are open"
            )
        if not any(hmac.compare_digest(_digest(token), self._digest) for token in presented):
            return 401, "wrong token for this route"
        return None


def route_class(method: str, path: str) -> str | None:
    """How the middleware treats a route vLLM declares: `"status"` and `"inference"` are
    open without the token, `"guarded"` needs it; None for a route none of the lists names
    (guarded too, since the middleware fails closed: it is a route added since these lists
    were checked, to be classified).

    Args:
        method: The HTTP method (`HEAD` is `GET`), or `WEBSOCKET`.
        path: The route's path template as vLLM declares it (`/v1/responses/{response_id}`).
    """
    method = "GET" if method.upper() == "HEAD" else method.upper()
    if (method, path) in STATUS_ROUTES:
        return "status"
    if _INFERENCE.fullmatch(path) is not None:
        return "inference"
    if (method, path) in GUARDED_ROUTES:
        return "guarded"
    return None


def _templates_pattern(templates: Iterable[str]) -> re.Pattern[str]:
    """One pattern matching any of `templates`, where `{name}` is one path segment (as
    Starlette's default path parameter is)."""
    alternatives = [
        "".join(
            "[^/]+" if re.fullmatch(r"\{\w+\}", part) else re.escape(part) for part in re.split(r"(\{\w+\})", template)
        )
        for template in sorted(templates)
    ]
    return re.compile("|".join(f"(?:{alternative})" for alternative in alternatives) or "(?!)")


def _route_path(scope: Scope) -> str:
    """The path vLLM's router matches: below `root_path` when the path starts with it
    (Starlette's `get_route_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def _is_cors_preflight(scope: Scope) -> bool:
    """An `OPTIONS` request that Starlette's `CORSMiddleware` answers itself."""
    names = {name.lower() for name, _ in scope.get("headers", [])}
    return b"origin" in names and b"access-control-request-method" in names


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _presented_tokens(scope: Scope) -> list[bytes]:
    """Every token the request carries: bearer credentials and the dedicated header."""
    found = []
    for name, value in scope.get("headers", []):
        name, value = name.lower(), value.strip()
        if name == b"authorization":
            scheme, _, credentials = value.partition(b" ")
            if scheme.lower() == b"bearer" and credentials.strip():
                found.append(credentials.strip())
        elif name == TOKEN_HEADER.lower().encode() and value:
            found.append(value)
    return found


_INFERENCE = _templates_pattern(INFERENCE_ROUTES)


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="delta-sync"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
