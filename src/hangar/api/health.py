"""``/health`` (no key) and ``/metrics`` (Prometheus text, key required)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hangar import __version__
from hangar.api.auth import require_key
from hangar.api.models import Health

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=Health, summary="Liveness; needs no API key")
async def health(request: Request) -> Health:
    m = request.app.state.manager
    counts = m.state_counts()  # one indexed query over live rows, never the tombstones
    return Health(status="ok", version=__version__, engine=m.describe_engine(),
                  sandboxes=sum(n for s, n in counts.items() if s not in ("failed", "pooled")))


@router.get("/metrics", dependencies=[Depends(require_key)],
            summary="Prometheus metrics (text exposition format)",
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
