"""Probes and metrics (always public).

``/health`` is liveness: 200 whenever the process serves HTTP, independent of Triton, so an
orchestrator never restarts the gateway for a backend problem. ``/ready`` is readiness: 503 until
Triton answers and both pipeline models are ready, so traffic only goes where it can be served.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.dependencies import MetricsDep, SettingsDep, TritonClientDep
from gateway.errors import ShuttingDown

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request, triton: TritonClientDep, settings: SettingsDep) -> dict[str, str]:
    if request.app.state.drain.draining:  # stop sending traffic here: the process is about to exit
        raise ShuttingDown("The server is shutting down.", retry_after=settings.retry_after_s)
    await triton.check_ready(settings.ready_timeout_s)
    return {"status": "ready"}


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
