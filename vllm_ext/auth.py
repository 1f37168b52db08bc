"""A bearer token on the routes that change what a vLLM server serves.

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

A request to a guarded route ([`GUARDED_ROUTES`]) must then carry the token, as
`Authorization: Bearer <token>` or as `X-Delta-Sync-Token: <token>` (for servers behind a
proxy that takes `Authorization` for itself, such as a private Hugging Face Space). Other
routes (completions, health, metrics) are left to vLLM: `--api-key` governs `/v1`.

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
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, ClassVar

# Defined once, in the control-plane contract both sides import.
from delta_sync.control import API_TOKEN_ENV, TOKEN_HEADER

__all__ = ["API_TOKEN_ENV", "GUARDED_ROUTES", "TOKEN_HEADER", "WeightRouteAuthMiddleware"]

logger = logging.getLogger("delta_sync")


#: vLLM 0.32's routes that change weights, generation, caches or memory, call into the
#: workers, or reveal the server's configuration (`VLLM_SERVER_DEV_MODE=1` opens most of
#: them). Read-only status routes (`/is_paused`, `/weight_info`, `/is_sleeping`, ...) stay
#: open, like `/health`.
GUARDED_ROUTES = frozenset(
    {
        # weight updates (vllm/entrypoints/rl/online/api_router.py)
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_checker",  # its "reset" action reloads the weights
        # generation
        "/pause",
        "/resume",
        "/abort_requests",
        # any method of any worker (vllm/entrypoints/serve/dev/rpc)
        "/collective_rpc",
        # caches and memory (vllm/entrypoints/serve/dev/cache, dev/sleep)
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
        # profiling, scaling, fault tolerance, configuration
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/fault_tolerance/apply",
        "/server_info",
    }
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class WeightRouteAuthMiddleware:
    """ASGI middleware requiring a token on [`GUARDED_ROUTES`].

    vLLM builds it with no arguments (`--middleware vllm_ext.auth.WeightRouteAuthMiddleware`),
    so the token comes from `$DELTA_SYNC_API_TOKEN`. Tokens are compared in constant time.

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

    #: Paths that need the token; a subclass may extend them.
    guarded_routes: ClassVar[frozenset[str]] = GUARDED_ROUTES

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        token = os.environ.get(API_TOKEN_ENV, "") if token is None else token
        # Digests have one length whatever the token's: the comparison leaks neither.
        self._digest = _digest(token.strip().encode()) if token.strip() else None
        if self._digest is None:
            logger.error(
                "delta-sync: %s is not set: the weight-update and RPC routes of this server are closed "
                "(every request to them is refused with 403)",
                API_TOKEN_ENV,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self._is_guarded(scope):
            refusal = self._refusal(scope)
            if refusal is not None:
                logger.warning("delta-sync: refused %s %s: %s", scope.get("method", "WS"), scope["path"], refusal[1])
                await _refuse(scope, send, *refusal)
                return
        await self.app(scope, receive, send)

    def _is_guarded(self, scope: Scope) -> bool:
        if scope.get("method") == "OPTIONS":  # CORS preflight: changes nothing
            return False
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        # Routing is exact, but a trailing slash or case variant must not slip past either.
        return (path.rstrip("/") or "/").lower() in self.guarded_routes

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request may not pass, else None."""
        if self._digest is None:
            return 403, f"this server has no {API_TOKEN_ENV} set, so its weight-update routes are closed"
        presented = _presented_tokens(scope)
        if not presented:
            return 401, f"this route needs the server's token (Authorization: Bearer <token>, or {TOKEN_HEADER})"
        if not any(hmac.compare_digest(_digest(token), self._digest) for token in presented):
            return 401, "wrong token for this route"
        return None


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
