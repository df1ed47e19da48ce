"""Upload sessions: open, forward (relay), status, resume offset, PUT a file, commit, discard."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Request, Response

from lorafleet._service import errors
from lorafleet.agent._body import RAW_BODY
from lorafleet.agent.routes import AgentRoutes
from lorafleet.protocol.agent import (
    CONTENT_DIGEST_HEADER,
    REPR_DIGEST_HEADER,
    UPLOAD_OFFSET_HEADER,
    AdapterRecord,
    FileProgress,
    ForwardPlan,
    OpenUploadRequest,
    UploadSession,
    UploadStatus,
)

__all__ = ["routes"]


def routes(ctx: AgentRoutes) -> APIRouter:
    """This group's routes over ``ctx.rt``."""
    api = APIRouter()
    rt = ctx.rt
    guard = ctx.guard
    ctl = ctx.ctl
    upload_access = ctx.upload_access

    @api.post(
        "/v1/uploads",
        status_code=201,
        dependencies=guard,
        responses=errors(*ctl, 409, 413, 503, 507),
    )
    async def open_upload(req: OpenUploadRequest) -> UploadSession:
        """Open an upload; refuses over-cap files, quota, bad paths and stale versions at once.
        With ``relay``, peers presenting the publication's credential may PUT its files."""
        return await rt.service.open_upload(req.manifest, supersede=req.supersede, relay=req.relay)

    @api.post("/v1/uploads/{upload_id}/forward", dependencies=guard, responses=errors(*ctl, 404))
    async def forward(upload_id: str, plan: ForwardPlan) -> UploadStatus:
        """Relay: forward these files to these peers' sessions while they stream in (each file
        from its first byte, once). Refuses a path this session is not about to receive."""
        return rt.uploads.set_forward(upload_id, plan)

    @api.get("/v1/uploads/{upload_id}", dependencies=guard, responses=errors(*ctl, 404))
    async def upload_status(upload_id: str) -> UploadStatus:
        return rt.uploads.status(upload_id)

    @api.head(
        "/v1/uploads/{upload_id}/files/{path:path}",
        response_class=Response,
        responses={
            200: {
                "description": "The durable offset, in the Upload-Offset header (no body)",
                "headers": {
                    UPLOAD_OFFSET_HEADER: {"required": True, "schema": {"type": "integer"}}
                },
            },
            **errors(*ctl, 404),
        },
    )
    async def upload_offset(
        upload_id: str, path: str, _peer: bool = Depends(upload_access)
    ) -> Response:
        """The durable offset of one file, in the Upload-Offset header."""
        off = rt.uploads.offset(upload_id, path)
        return Response(status_code=200, headers={UPLOAD_OFFSET_HEADER: str(off)})

    @api.put(
        "/v1/uploads/{upload_id}/files/{path:path}",
        responses=errors(*ctl, 404, 408, 409, 413, 422, 507),
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "Raw file bytes, starting at Upload-Offset.",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def upload_file(
        request: Request,
        upload_id: str,
        path: str,
        upload_offset: int | None = Header(
            None, alias=UPLOAD_OFFSET_HEADER, ge=0, description="Resume from this byte offset."
        ),
        repr_digest: str | None = Header(
            None, alias=REPR_DIGEST_HEADER, description="RFC 9530: sha-256 of the whole file."
        ),
        content_digest: str | None = Header(
            None, alias=CONTENT_DIGEST_HEADER, description="RFC 9530: sha-256 of this body."
        ),
        peer: bool = Depends(upload_access),
    ) -> FileProgress:
        """Stream one file's bytes; verified against the manifest's size and sha256."""
        # The transport's own header (HTTP framing has already checked it), not a parameter.
        declared = request.headers.get("content-length")
        content_length = int(declared) if declared and declared.isdigit() else None
        return await rt.uploads.put(
            upload_id,
            path,
            request.stream(),
            offset=upload_offset,
            content_length=content_length,
            repr_digest=repr_digest,
            content_digest=content_digest,
            peer=peer,
            raw=request.scope.get("extensions", {}).get(RAW_BODY),
        )

    @api.post(
        "/v1/uploads/{upload_id}/commit",
        dependencies=guard,
        responses=errors(*ctl, 404, 409, 413, 422, 503, 507),
    )
    async def commit(upload_id: str) -> AdapterRecord:
        return await rt.service.commit(upload_id)

    @api.delete(
        "/v1/uploads/{upload_id}",
        status_code=204,
        dependencies=guard,
        response_class=Response,
        responses=errors(*ctl, 404, 413),
    )
    async def discard(upload_id: str) -> Response:
        rt.uploads.get(upload_id)
        await rt.uploads.aclose(upload_id, keep_blobs=False)
        return Response(status_code=204)

    # --- adapters --------------------------------------------------------------------------
    return api
