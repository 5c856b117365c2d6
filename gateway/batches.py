"""`/v1/batches`: OpenAI's Batch API over an uploaded JSONL file, as the SDK's `client.batches` uses it. A new batch
is `validating`; a gateway's `BatchDriver` then runs it (`gateway/batch_driver.py`). A batch is its creator's:
another API key gets 404 for it and does not see it listed."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from client.openai_format import CHAT, COMPLETIONS
from gateway.auth import tenant_of
from gateway.batch_http import answered, listing, not_found, owned, owner
from gateway.batch_store import ENDED, WINDOW_S, new_id
from gateway.bodies import read_json
from gateway.errors import APIError
from gateway.state import Gateway

ENDPOINTS = (CHAT, COMPLETIONS)
WINDOWS = ("24h",)
# OpenAI's bounds on `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_PAIRS, MAX_KEY, MAX_VALUE = 16, 64, 512


def _invalid(message: str, param: str) -> APIError:
    return APIError(400, message, code="invalid_request", param=param)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_PAIRS:
        raise _invalid(f"metadata must be an object of at most {MAX_PAIRS} pairs", "metadata")
    for key, text in value.items():
        if len(key) > MAX_KEY or not isinstance(text, str) or len(text) > MAX_VALUE:
            raise _invalid(f"metadata keys hold up to {MAX_KEY} characters, values are strings up to {MAX_VALUE}",
                           "metadata")  # fmt: skip
    return value


@answered
async def create_batch(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    body = await read_json(request, gateway.settings.max_body_bytes)
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in ENDPOINTS:
        raise _invalid(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}", "endpoint")
    if window not in WINDOWS:
        raise _invalid(f"completion_window must be one of {', '.join(WINDOWS)}, not {window!r}", "completion_window")
    metadata = _metadata(body.get("metadata"))
    who, file_id = owner(request), body.get("input_file_id")
    source = await gateway.batches.file(who, file_id) if isinstance(file_id, str) else None
    if source is None or not isinstance(file_id, str):
        raise APIError(404, f"No such file: {file_id!r}.", code="not_found", param="input_file_id")
    if source["purpose"] != "batch":
        raise _invalid(f"the file's purpose is {source['purpose']!r}, not 'batch'", "input_file_id")
    now = int(time.time())
    record = {
        "id": new_id("batches"),
        "object": "batch",
        "endpoint": endpoint,
        "model": None,
        "errors": None,
        "input_file_id": file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + WINDOW_S,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
        "_owner": who,
        "_tenant": tenant_of(request.scope),  # its requests are submitted as the key's tenant
        "_output_file": new_id("files"),  # reserved now, so a finalizing step redone writes the same files
        "_error_file": new_id("files"),
    }
    await gateway.batches.keep_file(file_id, gateway.settings.batch_ttl_s + WINDOW_S)
    await gateway.batches.put_batch(record)
    return JSONResponse(await gateway.batches.shown(record))


@answered
async def get_batch(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return JSONResponse(await gateway.batches.shown(await owned(request, "batch")))


@answered
async def cancel_batch(request: Request) -> Response:
    """`cancelling` at once; the batch's driver stops its lines and makes it `cancelled`, with what had finished."""
    gateway: Gateway = request.app.state.gateway
    batch_id = (await owned(request, "batch"))["id"]

    def cancelling(record: dict[str, Any]) -> dict[str, Any] | None:
        if record["status"] in ENDED or record["status"] == "cancelling":
            return None
        return {"status": "cancelling", "cancelling_at": int(time.time())}

    record = await gateway.batches.update(batch_id, cancelling)
    if record is None:
        raise not_found("batch", batch_id)
    if record["status"] in ENDED - {"cancelled"}:
        message = f"Cannot cancel a batch with status {record['status']!r}."
        raise APIError(409, message, code="batch_not_cancellable", param="batch_id")
    return JSONResponse(await gateway.batches.shown(record))


@answered
async def list_batches(request: Request) -> Response:
    return await listing(request, "batches", default_limit=20, most=100)
