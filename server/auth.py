"""Bearer-key authentication. Keys map to tenants; with no key configured every request is the
single tenant "default" (the settings then allow loopback binds only)."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import invalid_api_key
from server.settings import DEFAULT_TENANT, ServerSettings


def tenant_session_id(tenant: str, session_id: str) -> str:
    """The engine-side id of a tenant's session: tenants never see each other's sessions.

    Also its id in the memory store (the engine's document manifests, the server's session
    records), so it uses only the store's id characters: a tenant id is hex (or "default") and
    never holds the "." that separates it from a session id this server handed out."""
    return f"{tenant}.{session_id}"


def authenticate(settings: ServerSettings, authorization: str | None) -> str:
    """The tenant for an Authorization header, or an APIError (401)."""
    tenants = settings.tenants()
    if not tenants:
        return DEFAULT_TENANT
    if not authorization:
        raise invalid_api_key(
            "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'."
        )
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise invalid_api_key("Malformed Authorization header; expected 'Bearer <key>'.")
    tenant = None
    for known, known_tenant in tenants.items():
        # Compare against every key so timing does not tell which prefix matched.
        if hmac.compare_digest(known.encode(), key.encode()):
            tenant = known_tenant
    if tenant is None:
        raise invalid_api_key("Incorrect API key provided.")
    return tenant


async def require_tenant(request: Request) -> str:
    """FastAPI dependency for every /v1 route; stores the tenant on request.state too."""
    settings: ServerSettings = request.app.state.settings
    tenant = authenticate(settings, request.headers.get("authorization"))
    request.state.tenant = tenant
    return tenant
