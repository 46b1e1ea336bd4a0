"""``/sandboxes/{id}/ports``: expose, list, show and close guest TCP ports.

The requests to an exposed port are forwarded by ``hangar.api.proxy``;
these routes only manage the exposures (``hangar.core.ports``) and say
where each port is reached. Every answer about a private port carries a
fresh signed URL (``token_ttl`` seconds, default ``HANGAR_PORT_TOKEN_TTL_S``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from hangar.api.deps import manager
from hangar.api.proxy import TOKEN_PARAM, host_url, path_prefix
from hangar.core.service import Exposure, SandboxManager
from hangar.schemas import ExposePort, PortInfo
from hangar.schemas.bounds import PORT_MAX, PORT_MIN, TTL_MAX_S

router = APIRouter(prefix="/sandboxes", tags=["ports"])
Manager = Annotated[SandboxManager, Depends(manager)]
PortNumber = Annotated[int, Path(ge=PORT_MIN, le=PORT_MAX, description="The guest's TCP port.")]
TokenTtl = Annotated[float | None, Query(gt=0, le=TTL_MAX_S, description=(
    "Lifetime of the signed URLs in the answer, seconds (default HANGAR_PORT_TOKEN_TTL_S)."))]


def view(request: Request, m: SandboxManager, e: Exposure, ttl: float | None) -> PortInfo:
    """The wire form of ``e``; a private port gets a token valid ``ttl`` seconds."""
    scheme = request.url.scheme
    origin = f"{scheme}://{request.url.netloc}"
    root = request.scope.get("root_path", "").rstrip("/")
    path = f"{origin}{root}{path_prefix(e.sandbox_id, e.port)}/"
    by_host = host_url(scheme, m.settings.domain, e.sandbox_id, e.port)
    url = by_host or path
    token: str | None = None
    expires: float | None = None
    if not e.public:
        token, stamp = m.ports.token(e, ttl)
        expires = float(stamp)
    return PortInfo(sandbox_id=e.sandbox_id, port=e.port, public=e.public, url=url,
                    path_url=path, host_url=by_host, created_at=e.created_at, token=token,
                    token_expires_at=expires,
                    signed_url=f"{url}?{TOKEN_PARAM}={token}" if token else None)


@router.post("/{sandbox_id}/ports", response_model=PortInfo, status_code=201,
             responses={200: {"model": PortInfo, "description": "It was exposed already "
                                                                 "(``public`` updated)."}},
             summary="Expose a guest TCP port through this server (HTTP and WebSockets)")
async def expose(sandbox_id: str, body: ExposePort, request: Request, response: Response,
                 m: Manager) -> PortInfo:
    existed = any(e.port == body.port for e in m.ports.list(sandbox_id))
    e = m.ports.expose(sandbox_id, body.port, body.public)
    if existed:
        response.status_code = 200
    return view(request, m, e, body.token_ttl)


@router.get("/{sandbox_id}/ports", response_model=list[PortInfo],
            summary="The sandbox's exposed ports, with their URLs")
async def list_(sandbox_id: str, request: Request, m: Manager,
                token_ttl: TokenTtl = None) -> list[PortInfo]:
    return [view(request, m, e, token_ttl) for e in m.ports.list(sandbox_id)]


@router.get("/{sandbox_id}/ports/{port}", response_model=PortInfo,
            summary="One exposed port, with its URLs (a new signed URL when private)")
async def get(sandbox_id: str, port: PortNumber, request: Request, m: Manager,
              token_ttl: TokenTtl = None) -> PortInfo:
    return view(request, m, m.ports.get(sandbox_id, port), token_ttl)


@router.delete("/{sandbox_id}/ports/{port}", status_code=204,
               summary="Stop exposing a port: its URLs answer 404, its tokens are void")
async def close(sandbox_id: str, port: PortNumber, m: Manager) -> Response:
    m.ports.close(sandbox_id, port)
    return Response(status_code=204)
