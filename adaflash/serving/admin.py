"""The server's operational routes: `/health` (the engine, the fast learner, feedback delivery),
`/metrics` (Prometheus) and `POST /admin/drafter/reload` (bearer token; 403 while no token is set).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from adaflash.errors import CheckpointError
from adaflash.serving.engine import Engine
from adaflash.serving.metrics import ServingMetrics
from adaflash.serving.protocol import ReloadBody, error_response
from adaflash.serving.reload import DrafterReloader


def suffix_health(engine: Engine, feed) -> dict:
    """The fast learner in `/health`: its size, tenants and the last clean offsets it applied."""
    body = engine.suffix_cache.stats().as_dict()
    body["tenant_ids"] = engine.suffix_cache.tenants()[:50]
    body["enabled"] = engine.suffix_cache.config.enabled
    if feed is not None:
        body["feed"] = {"ready": feed.ready, "applied": feed.applied, "error": feed.error}
    return body


class Admin:
    """The handlers; `state` is the app's state, where `launch.serve` puts the suffix feed once
    it has started."""

    def __init__(self, engine: Engine, metrics: ServingMetrics, reloader: DrafterReloader,
                 admin_token: str | None, feedback, state) -> None:  # fmt: skip
        self.engine, self.metrics, self.reloader = engine, metrics, reloader
        self.admin_token, self.feedback, self.state = admin_token, feedback, state

    async def health(self):
        engine = self.engine
        s = engine.scheduler
        alive = engine._thread is None or engine._thread.is_alive()
        ok = engine.failure is None and alive
        body = {
            "status": "ok" if ok else "error",
            "error": repr(engine.failure) if engine.failure else None,
            "running": len(s.running),
            "queue_depth": s.queue_depth,
            "drafter_version": engine.drafter_version,
            "method": engine.config.method,
            "reloads": engine.reloads,
        }
        body["suffix_cache"] = suffix_health(engine, getattr(self.state, "suffix_feed", None))
        body["prefix_cache"] = engine.prefix_cache.stats()
        if self.feedback is not None:
            body["feedback"] = fb = self.feedback.health()
            if ok and fb["degraded"]:  # still 200: serving works, and a restart would lose held records
                body["status"] = "degraded"
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def _refused(self, http: HttpRequest) -> JSONResponse | None:
        """403 while the admin API is off, 401 without the right bearer token, else None."""
        if not self.admin_token:
            return error_response(
                403, "the admin API is disabled: set ADAFLASH_ADMIN_TOKEN", "permission_error"
            )
        auth = http.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.admin_token.encode()):
            return error_response(401, "missing or wrong bearer token", "authentication_error")
        return None

    async def reload(self, body: ReloadBody, http: HttpRequest):
        if (refused := self._refused(http)) is not None:
            return refused
        previous = self.engine.drafter_version
        try:
            version = await asyncio.wrap_future(self.reloader.reload(body.path, body.version))
        except CheckpointError as e:
            return error_response(422, f"reload rejected, still serving {previous}: {e}", "checkpoint_error")
        except OSError as e:  # a path the filesystem refuses (too long, a loop, no permission)
            why = f"cannot read the checkpoint: {e.strerror or type(e).__name__}"
            return error_response(
                422, f"reload rejected, still serving {previous}: {why}", "checkpoint_error"
            )
        return {"status": "staged", "version": version, "previous": previous}
