"""What is served and how it is: models, health, version, metrics."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from atom_anyio.api.runtime import Runtime
from atom_anyio.version import __version__


def status_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("status", __name__)

    def model_card() -> dict[str, Any]:
        return {
            "id": rt.model_name,
            "object": "model",
            "created": int(rt.started_at),
            "owned_by": "atom_anyio",
            "root": rt.config.model or rt.loaded.name,
            "max_model_len": rt.max_model_len,
        }

    @bp.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @bp.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Any:
        rt.check_model(model_id)
        return model_card()

    @bp.get("/health")
    async def health() -> Any:
        if rt.is_healthy:
            return {"status": "ok"}
        return {"status": "unavailable", "error": rt.engine.error}, 503

    @bp.get("/version")
    async def version() -> Any:
        model = rt.loaded.model
        return {"version": __version__, "attention_backend": model.attention_backend.name, "dtype": model.dtype_name}

    @bp.get("/metrics")
    async def metrics() -> Any:
        return Response(rt.metrics.render(), mimetype="text/plain; version=0.0.4")

    return bp
