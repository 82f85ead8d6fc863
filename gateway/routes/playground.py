"""``GET /playground``: a static page to try voices by ear (no build step, public like /health).

The page itself holds no secret and calls only the /v1 routes, with the API key the user types in;
so it is served without a key even when ``TTS_API_KEYS`` is set. docs/gateway.md#playground.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

router = APIRouter()

PLAYGROUND_PAGE = Path(__file__).resolve().parent.parent / "playground" / "index.html"


@router.get("/playground", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(PLAYGROUND_PAGE, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    """Browsers ask every origin for one (the playground's page too): nothing to show, and no 404 to log."""
    return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})
