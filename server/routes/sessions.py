"""/v1/sessions, /v1/sessions/{id}/documents and /v1/sessions/{id}/collections (longserve's own
API; the openai SDK reaches it with plain HTTP). Every route looks the session up by (tenant, id) first (restoring it from the
memory store when this replica does not hold it), so another tenant's session is a 404 before
its body is even read. Listing shows the tenant's sessions from the memory store's tenant index
(every replica's), or only those this replica holds when there is no store or it is down: a
partial list beats a 503 for a read that changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from starlette.datastructures import UploadFile

from server.auth import require_tenant
from server.documents import Upload, split_content_type
from server.errors import error_responses, invalid_request, unsupported_media_type
from server.limits import JSONBodyRoute
from server.protocol_sessions import (
    CollectionAttachRequest,
    DocumentCreateRequest,
    SessionCollection,
    SessionCollectionList,
    SessionCreateRequest,
    SessionDeleted,
    SessionDocument,
    SessionDocumentList,
    SessionList,
    SessionObject,
)
from server.routes.dependencies import Sessions
from server.serving.sse import STREAM_OK
from server.sessions import SessionRegistry

router = APIRouter(
    prefix="/v1",
    route_class=JSONBodyRoute,
    responses=error_responses(400, 401, 404, 409, 413, 415, 429, 431, 500, 503),
)

# The documents route reads its body itself (JSON or multipart), so it declares it here.
DOCUMENT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": DocumentCreateRequest.model_json_schema()},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "name": {"type": "string"},
                    },
                    "required": ["file"],
                }
            },
        },
    }
}


@router.post("/sessions", response_model=SessionObject)
async def create_session(
    registry: Sessions,
    body: SessionCreateRequest | None = None,
    tenant: str = Depends(require_tenant),
) -> SessionObject:
    return registry.view(await registry.create(tenant, body or SessionCreateRequest()))


@router.get("/sessions", response_model=SessionList)
async def list_sessions(registry: Sessions, tenant: str = Depends(require_tenant)) -> SessionList:
    return SessionList(data=await registry.list_views(tenant))


@router.get("/sessions/{session_id}", response_model=SessionObject)
async def retrieve_session(
    session_id: str, registry: Sessions, tenant: str = Depends(require_tenant)
) -> SessionObject:
    return registry.view(await registry.lookup(tenant, session_id))


@router.delete("/sessions/{session_id}", response_model=SessionDeleted)
async def delete_session(
    session_id: str, registry: Sessions, tenant: str = Depends(require_tenant)
) -> SessionDeleted:
    await registry.delete(tenant, session_id)
    return SessionDeleted(id=session_id)


@router.post(
    "/sessions/{session_id}/collections",
    response_model=SessionCollection,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": CollectionAttachRequest.model_json_schema()}
            },
        }
    },
)
async def attach_collection(
    session_id: str, request: Request, registry: Sessions, tenant: str = Depends(require_tenant)
) -> SessionCollection:
    """Attach a collection written by `longserve ingest` (operator-written, readable by every
    tenant). Idempotent: attaching it again answers the same object. The body is read after
    the session is found, so another tenant's session is a 404 whatever the body."""
    await registry.lookup(tenant, session_id)
    body = CollectionAttachRequest.model_validate_json(await request.body())
    attached = await registry.collections.attach(tenant, session_id, body.name)
    return attached.view(session_id)


@router.get("/sessions/{session_id}/collections", response_model=SessionCollectionList)
async def list_collections(
    session_id: str, registry: Sessions, tenant: str = Depends(require_tenant)
) -> SessionCollectionList:
    session = await registry.lookup(tenant, session_id)
    return SessionCollectionList(data=[c.view(session_id) for c in session.collections.values()])


@router.post(
    "/sessions/{session_id}/documents",
    response_model=SessionDocument,
    openapi_extra=DOCUMENT_BODY,
    responses=error_responses(422),
)
async def add_document(
    session_id: str, request: Request, registry: Sessions, tenant: str = Depends(require_tenant)
) -> SessionDocument:
    await registry.lookup(tenant, session_id)
    upload = await read_upload(request, registry)
    doc = await registry.documents.add(tenant, session_id, upload)
    return doc.view()


@router.get("/sessions/{session_id}/documents", response_model=SessionDocumentList)
async def list_documents(
    session_id: str, registry: Sessions, tenant: str = Depends(require_tenant)
) -> SessionDocumentList:
    session = await registry.lookup(tenant, session_id)
    return SessionDocumentList(data=[d.view() for d in session.documents.values()])


@router.get(
    "/sessions/{session_id}/documents/{document_id}",
    response_model=SessionDocument,
    responses=STREAM_OK,
)
async def retrieve_document(
    session_id: str,
    document_id: str,
    registry: Sessions,
    stream: bool = False,
    tenant: str = Depends(require_tenant),
) -> SessionDocument | Response:
    doc = await registry.documents.get(tenant, session_id, document_id)
    if not stream:
        return doc.view()
    return EventSourceResponse(_progress_events(registry.documents.watch(doc)), sep="\n")


async def _progress_events(views: AsyncIterator[SessionDocument]) -> AsyncIterator[str]:
    async for view in views:
        yield view.model_dump_json()
    yield "[DONE]"


async def read_upload(request: Request, registry: SessionRegistry) -> Upload:
    """JSON {"text", "name"} or multipart/form-data with `file` (and optional `name`)."""
    media, _ = split_content_type(request.headers.get("content-type"))
    if media == "application/json":
        body = DocumentCreateRequest.model_validate_json(await request.body())
        return Upload(name=body.name, text=body.text)
    if media == "multipart/form-data":
        max_bytes = registry.reader.limits.max_bytes
        async with request.form(max_files=1, max_fields=4) as form:
            file = form.get("file")
            if not isinstance(file, UploadFile):
                raise invalid_request("Missing required parameter: 'file'.", param="file")
            name = form.get("name")
            # One byte past the limit is enough to know it is too large.
            data = await file.read(max_bytes + 1)
            return Upload(
                name=name if isinstance(name, str) else None,
                data=data,
                content_type=file.content_type,
                filename=file.filename,
            )
    raise unsupported_media_type(
        'Send the document as JSON {"text": ..., "name": ...} or as multipart/form-data '
        "with a 'file' part."
    )
