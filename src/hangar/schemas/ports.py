"""Wire schemas of exposed ports: a guest TCP port served over HTTP."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from hangar.schemas.base import Model, RequestBody
from hangar.schemas.bounds import PORT_MAX, PORT_MIN, TTL_MAX_S


class ExposePort(RequestBody):
    """Body of ``POST /sandboxes/{id}/ports``: expose a guest TCP port over HTTP."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(ge=PORT_MIN, le=PORT_MAX, strict=True,
                      description="TCP port the guest listens on (on any address, or 127.0.0.1).")
    public: bool = Field(False, strict=True, description=(
        "true: anyone with the URL reaches it. false (private): requests need X-API-Key or "
        "a signed URL's token."))
    token_ttl: float | None = Field(None, gt=0, le=TTL_MAX_S, description=(
        "Lifetime of the signed URL in the answer, seconds (default "
        "HANGAR_PORT_TOKEN_TTL_S, 3600)."))


class PortInfo(Model):
    """An exposed port and where to reach it.

    ``url`` is the address to use: ``host_url`` when the server has a domain
    (``HANGAR_DOMAIN``), else ``path_url``. A private port needs the
    ``X-API-Key`` header there, or ``signed_url``, which carries a token
    (``hangar_token=``) valid until ``token_expires_at`` for this port only;
    a browser that opens it gets a cookie for the rest of its visit.
    """

    sandbox_id: str
    port: int
    public: bool
    url: str
    path_url: str = Field(description="http(s)://<server>/sandboxes/<id>/ports/<port>/; the "
                                      "app gets X-Forwarded-Prefix: /sandboxes/<id>/ports/<port>.")
    host_url: str | None = Field(None, description="http(s)://<port>-<id>.<domain>/ when the "
                                                   "server has a domain, else null.")
    signed_url: str | None = Field(None, description="``url`` with a token; private ports only.")
    token: str | None = Field(None, description="The token alone (query hangar_token=).")
    token_expires_at: float | None = Field(None, description="Unix time, seconds.")
    created_at: float = Field(description="Unix time, seconds.")
