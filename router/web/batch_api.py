"""The Batch API's routes, in OpenAI's shapes: `/v1/files` (purpose `batch`) and `/v1/batches`.

Each route checks the client key (when keys are configured) and counts against its limits as
its row of `BATCH_ENDPOINTS` states (router/core/endpoints.py). A key reaches only its own files
and jobs (another's are 404). A job is checked whole at create, reading its file line by line
(router/batch/files.py): a bad line is a 400 naming it. Jobs live in Redis
(router/batch/store.py) and run on any replica (router/batch/runner.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, JSONResponse, Response

from router.batch.files import BadFile, Storage, TooBig
from router.batch.runner import names
from router.batch.store import INT_FIELDS, BatchStore
from router.batch.upload import BadUpload, boundary_from
from router.core.endpoints import BATCH_ENDPOINTS, BATCH_URLS, Endpoint
from router.core.errors import (
    STORE_FAILURES,
    BadRequest,
    Refused,
    TooLarge,
    Unavailable,
    Unknown,
    answer,
)
from router.core.fastjson import loads
from router.core.settings import BatchConfig
from router.registry.fleet import Registry
from router.request.admit.quota import QuotaBook
from router.request.admit.validate import request_id_of
from router.request.lifecycle.getting_in import limits_for
from router.request.placement.response_ids import ANONYMOUS
from router.web.auth import ClientKey, ClientKeys

Route = Callable[[Request, ClientKey | None, str], Awaitable[Response]]
WINDOW = 24 * 3600  # the one completion_window OpenAI takes: "24h"


def batch_routes(
    cfg: BatchConfig,
    store: BatchStore,
    storage: Storage,
    registry: Registry,
    keys: ClientKeys,
    quotas: QuotaBook,
    max_line_bytes: int,
) -> APIRouter:
    router = APIRouter()
    check = keys.check if keys.enabled else None

    def route(row: Endpoint, run: Route) -> None:
        async def handler(request: Request) -> Response:
            request_id = request_id_of(request.headers.get("x-request-id"))
            try:
                key = check(request) if check is not None else None
                hold = None
                if key is not None and key.limits is not None:
                    hold = await quotas.admit(limits_for(row, key.limits), 0, request_id)
                try:
                    return await run(request, key, request_id)
                finally:
                    if hold is not None:
                        hold.close(0)
            except Refused as refused:
                refused.request_id = refused.request_id or request_id
                return answer(refused)
            except STORE_FAILURES:
                return answer(Unavailable("The batch store is unavailable; retry.", status=503))

        handler.__name__ = row.method.lower() + "_" + row.path.strip("/").replace("/", "_")
        router.add_api_route(row.path, handler, methods=[row.method], response_class=Response)

    def owner_of(key: ClientKey | None) -> str:
        return key.owner if key is not None else ANONYMOUS

    async def own_file(file_id: str, key: ClientKey | None) -> dict[str, Any]:
        record = await store.get_file(file_id)
        if record is None or record.get("owner") != owner_of(key):
            raise Unknown(f"No such File object: {file_id[:100]}", param="file_id")
        return record

    async def own_job(job_id: str, key: ClientKey | None) -> dict[str, str]:
        fields = await store.job(job_id)
        if fields is None or fields.get("owner") != owner_of(key):
            raise Unknown(f"No batch found with id '{job_id[:100]}'.", param="batch_id")
        return fields

    # --- files ----------------------------------------------------------------------------

    async def upload(request: Request, key: ClientKey | None, request_id: str) -> Response:
        owner = owner_of(key)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_file_bytes + 65536:
            raise TooLarge(f"The file is larger than {cfg.max_file_bytes} bytes.")
        if await store.file_count(owner) >= cfg.max_files_per_key:
            raise BadRequest(
                f"This key holds {cfg.max_files_per_key} files already; delete some first.",
                code="too_many_files",
            )
        try:
            boundary = boundary_from(request.headers.get("content-type"))
            file_id = f"file-{os.urandom(12).hex()}"
            path = f"{file_id}.jsonl"
            form = await storage.save(path, request.stream(), boundary, cfg.max_file_bytes)
        except BadUpload as bad:
            raise BadRequest(str(bad), code="invalid_form") from None
        except TooBig as big:
            raise TooLarge(str(big)) from None
        purpose = form.fields.get("purpose")
        if purpose != "batch":
            storage.remove(path)
            raise BadRequest("This router takes files of purpose 'batch' only.", param="purpose")
        record = {
            "id": file_id,
            "object": "file",
            "bytes": form.size,
            "created_at": int(time.time()),
            "filename": form.filename or "upload.jsonl",
            "purpose": "batch",
            "status": "processed",
            "owner": owner,
            "path": path,
        }
        await store.put_file(record, owner)
        return JSONResponse(_file(record))

    async def list_files(request: Request, key: ClientKey | None, request_id: str) -> Response:
        limit = _limit(request)
        data = [_file(r) for r in await store.list_files(owner_of(key), limit)]
        return JSONResponse({"object": "list", "data": data, "has_more": False})

    async def get_file(request: Request, key: ClientKey | None, request_id: str) -> Response:
        return JSONResponse(_file(await own_file(request.path_params["file_id"], key)))

    async def file_content(request: Request, key: ClientKey | None, request_id: str) -> Response:
        record = await own_file(request.path_params["file_id"], key)
        path = storage.path(record["path"])
        if not path.exists():
            raise Unknown("The file's content is gone from the storage.", param="file_id")
        return FileResponse(path, media_type="application/jsonl")

    async def delete_file(request: Request, key: ClientKey | None, request_id: str) -> Response:
        record = await own_file(request.path_params["file_id"], key)
        await store.drop_file(record["id"], record["owner"])
        storage.remove(record["path"])
        return JSONResponse({"id": record["id"], "object": "file", "deleted": True})

    # --- batches --------------------------------------------------------------------------

    async def create(request: Request, key: ClientKey | None, request_id: str) -> Response:
        raw = await _small_body(request)
        try:
            payload = loads(raw)
        except ValueError:
            raise BadRequest("The body is not valid JSON.") from None
        if not isinstance(payload, dict):
            raise BadRequest("The body must be a JSON object.")
        endpoint = payload.get("endpoint")
        if endpoint not in BATCH_URLS:
            raise BadRequest(f"endpoint must be one of {', '.join(BATCH_URLS)}.", param="endpoint")
        if payload.get("completion_window") != "24h":
            raise BadRequest("completion_window must be '24h'.", param="completion_window")
        metadata = payload.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > 16
            or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise BadRequest(
                "metadata: at most 16 string pairs (keys up to 64, values up to 512 characters).",
                param="metadata",
            )
        file_id = payload.get("input_file_id")
        if not isinstance(file_id, str):
            raise BadRequest("input_file_id is required.", param="input_file_id")
        record = await own_file(file_id, key)
        job_id = f"batch_{os.urandom(12).hex()}"
        src, idx = names(job_id)
        # The job reads its own link to the file: deleting the upload leaves the job whole.
        await asyncio.to_thread(storage.share, record["path"], src)
        try:
            checked = await asyncio.to_thread(
                storage.check,
                src,
                idx,
                endpoint,
                cfg.max_lines,
                max_line_bytes,
                registry.snapshot.by_model,
                key.models if key is not None else None,
            )
        except BadFile as bad:
            storage.remove(src)
            raise BadRequest(
                bad.message,
                code="invalid_batch_line" if bad.line else "invalid_file",
                param=bad.param or "input_file_id",
            ) from None
        now = int(time.time())
        job = {
            "id": job_id,
            "owner": owner_of(key),
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": "24h",
            "status": "in_progress",
            "created_at": str(now),
            "in_progress_at": str(now),
            "expires_at": str(now + WINDOW),
            "total": str(checked.lines),
            "completed": "0",
            "failed": "0",
            "model": checked.model,
            "metadata": _dumps(metadata),
        }
        if not await store.open_job(job, job["owner"], cfg.max_jobs_per_key):
            storage.remove(src)
            storage.remove(idx)
            raise Refused(
                f"This key has {cfg.max_jobs_per_key} batches not yet ended "
                "(batch.max_jobs_per_key); wait for one to end.",
                status=429,
                code="too_many_batches",
            )
        return JSONResponse(_batch(job))

    async def list_batches(request: Request, key: ClientKey | None, request_id: str) -> Response:
        limit = _limit(request)
        after = request.query_params.get("after")
        ids = await store.job_ids(owner_of(key), after, limit + 1)
        jobs = [j for j in [await store.job(i) for i in ids[:limit]] if j is not None]
        data = [_batch(j) for j in jobs]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ids) > limit,
            }
        )

    async def get_batch(request: Request, key: ClientKey | None, request_id: str) -> Response:
        return JSONResponse(_batch(await own_job(request.path_params["batch_id"], key)))

    async def cancel(request: Request, key: ClientKey | None, request_id: str) -> Response:
        job_id = request.path_params["batch_id"]
        await own_job(job_id, key)
        await store.cancel(job_id, int(time.time()))
        return JSONResponse(_batch(await own_job(job_id, key)))

    runs: dict[tuple[str, str], Route] = {
        ("POST", "/v1/files"): upload,
        ("GET", "/v1/files"): list_files,
        ("GET", "/v1/files/{file_id}"): get_file,
        ("GET", "/v1/files/{file_id}/content"): file_content,
        ("DELETE", "/v1/files/{file_id}"): delete_file,
        ("POST", "/v1/batches"): create,
        ("GET", "/v1/batches"): list_batches,
        ("GET", "/v1/batches/{batch_id}"): get_batch,
        ("POST", "/v1/batches/{batch_id}/cancel"): cancel,
    }
    for row in BATCH_ENDPOINTS:
        route(row, runs[(row.method, row.path)])
    return router


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "20")
    return max(1, min(100, int(raw))) if raw.isdigit() else 20


async def _small_body(request: Request, most: int = 64 * 1024) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > most:
            raise TooLarge(f"The body is larger than {most} bytes.")
    return bytes(body)


def _dumps(value: Any) -> str:
    return json.dumps(value)


def _file(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("owner", "path")}


def _batch(f: dict[str, str]) -> dict[str, Any]:
    """A job's hash as OpenAI's Batch object."""
    out: dict[str, Any] = {
        "id": f["id"],
        "object": "batch",
        "endpoint": f["endpoint"],
        "model": f.get("model"),
        "errors": None,
        "input_file_id": f["input_file_id"],
        "completion_window": f["completion_window"],
        "status": f["status"],
        "output_file_id": f.get("output_file_id"),
        "error_file_id": f.get("error_file_id"),
        "request_counts": {
            "total": int(f["total"]),
            "completed": int(f.get("completed", 0)),
            "failed": int(f.get("failed", 0)),
        },
        "metadata": json.loads(f.get("metadata") or "null"),
    }
    for name in INT_FIELDS:
        out[name] = int(f[name]) if name in f else None
    return out
