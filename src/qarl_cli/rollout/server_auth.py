"""The key guard of the vLLM servers qarl runs (`--middleware qarl_cli.rollout.server_auth.KeyGuard`).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere: the RL routes that replace a model's weights
(/start_weight_update, /update_weights, ...), /pause and the dev routes stay open. This guard refuses every
request without `Authorization: Bearer <key>` except /health (what a load balancer or qarl's start-up probe asks,
which reveals nothing). The key comes from the server's environment (QARL_SERVER_KEY), never its command line
(which `ps` shows to every user)."""

from __future__ import annotations

import hmac
import json
import os

KEY_ENV = "QARL_SERVER_KEY"
OPEN_PATHS = frozenset({"/health"})


class KeyGuard:
    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{KEY_ENV} is not set: a qarl server never runs without a key")
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "unauthorized: this server needs the run's key"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
