"""`/v1/files`: the input files of batches (purpose `batch`, JSONL up to `batch_file_max_bytes`) and the output and
error files batches write, as the OpenAI SDK's `client.files` uses them. A file is its creator's (`owner_of`):
another API key gets 404 for it and does not see it listed."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.batch_http import answered, listing, not_found, owned, owner
from gateway.batch_upload import read_form
from gateway.errors import APIError
from gateway.state import Gateway

PURPOSES = ("batch",)


@answered
async def create_file(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    form = await read_form(request, gateway.settings.batch_file_max_bytes)
    purpose = form["purpose"].data.decode(errors="replace") if "purpose" in form else None
    if purpose not in PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}.", code="invalid_request",
                       param="purpose")  # fmt: skip
    upload = form.get("file")
    if upload is None:
        raise APIError(400, "The form needs a file part named 'file'.", code="invalid_request", param="file")
    record = await gateway.batches.put_file(owner(request), upload.filename or "file", purpose, upload.data)
    return JSONResponse(await gateway.batches.shown(record))


@answered
async def get_file(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return JSONResponse(await gateway.batches.shown(await owned(request, "file")))


@answered
async def file_content(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    file_id = (await owned(request, "file"))["id"]
    data = await gateway.batches.file_data(file_id)
    if data is None:  # deleted since its record was read
        raise not_found("file", file_id)
    return Response(data, media_type="application/octet-stream")


@answered
async def delete_file(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    file_id = request.path_params["file_id"]
    reading = await gateway.batches.batches_reading(file_id)
    if reading and await gateway.batches.file(owner(request), file_id) is not None:
        message = f"The file is the input of the unfinished batch {reading[0]}: delete it once the batch has ended."
        raise APIError(409, message, code="file_in_use", param="file_id")
    if not await gateway.batches.delete_file(owner(request), file_id):
        raise not_found("file", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@answered
async def list_files(request: Request) -> Response:
    """The caller's files, newest first; `purpose` keeps those of one purpose (`batch`, `batch_output`)."""
    purpose = request.query_params.get("purpose")
    return await listing(
        request, "files", default_limit=10_000, most=10_000, keep=lambda record: purpose in (None, record["purpose"])
    )
