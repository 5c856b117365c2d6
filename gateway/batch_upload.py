"""A `multipart/form-data` upload (`POST /v1/files`, as the OpenAI SDKs send it), read whole under a size limit
and split into its fields. The stdlib's header parser reads the parameters (boundary, name, filename), so no
multipart package is needed; bodies are split exactly on the boundary, so a file's bytes come back untouched."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message

from starlette.requests import Request

from gateway.bodies import read_body
from gateway.errors import APIError

OVERHEAD = 64 * 1024  # what the form may hold beside the file: boundaries, part headers, the other fields


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None
    data: bytes


def _param(header_name: str, value: str, param: str) -> str | None:
    message = Message()
    message[header_name] = value
    found = message.get_param(param, header=header_name)
    if isinstance(found, tuple):  # RFC 2231 (name*=utf-8''...)
        found = str(found[2])
    return None if found is None else str(found)


async def read_form(request: Request, file_limit: int) -> dict[str, Part]:
    """The form's parts by name; a part over `file_limit` bytes is refused (413), early when the length says so."""
    content_type = request.headers.get("content-type", "")
    boundary = _param("content-type", content_type, "boundary")
    if not content_type.startswith("multipart/form-data") or not boundary:
        raise APIError(400, "Send the file as multipart/form-data.", code="invalid_request")
    body = await read_body(request, file_limit + OVERHEAD, too_large(file_limit))
    parts = split(body, boundary.encode())
    if any(len(part.data) > file_limit for part in parts.values()):
        raise too_large(file_limit)
    return parts


def split(body: bytes, boundary: bytes) -> dict[str, Part]:
    """The parts of a multipart body (RFC 7578); a malformed body is a 400."""
    sections = (b"\r\n" + body).split(b"\r\n--" + boundary)
    if len(sections) < 3 or not sections[-1].startswith(b"--"):
        raise APIError(400, "The multipart body is malformed.", code="invalid_request")
    parts = {}
    for section in sections[1:-1]:
        head, separator, data = section.partition(b"\r\n\r\n")
        if not separator:
            raise APIError(400, "A part of the multipart body has no headers.", code="invalid_request")
        disposition = ""
        for raw in head.decode("utf-8", errors="replace").split("\r\n"):
            key, _, value = raw.partition(":")
            if key.strip().lower() == "content-disposition":
                disposition = value.strip()
        name = _param("content-disposition", disposition, "name")
        if name is not None:
            parts[name] = Part(name, _param("content-disposition", disposition, "filename"), data)
    return parts


def too_large(limit: int) -> APIError:
    return APIError(413, f"The file is over the limit of {limit} bytes.", code="file_too_large", param="file")
