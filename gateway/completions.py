"""`POST /v1/chat/completions` and `POST /v1/completions`: an OpenAI body becomes one queued request
(`AsyncClient.submit`), whose answer is returned whole or streamed as server-sent events.

A streamed answer's headers wait for its first token (which the client waits for anyway), so every error
known by then, an expired deadline or a request the worker refused included, still gets its HTTP status; a
later one arrives as an error event before `data: [DONE]`, which the OpenAI SDKs raise. A client that goes
away cancels its request (`AsyncJob.cancel`: the worker stops it within one engine step); so does a request
that outlives its timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from client import AsyncJob, Delta, LLMQError, RequestFailed, ResultTimeout
from client.errors import Cancelled, RedisUnavailable
from client.openai_format import CHAT, COMPLETIONS, Translated, completion_body, echo_of, translate
from gateway.auth import bearer_token
from gateway.bodies import read_body
from gateway.chunks import ChunkMaker
from gateway.errors import APIError, from_exception, once_submitted, unknown_model
from gateway.metrics import CLIENT_CLOSED, label_model
from gateway.request_ids import request_id_for
from gateway.sse import DONE, ClientGone, EventStream, event, unless_disconnected
from gateway.state import Gateway

TIMEOUT_HEADER = "X-Request-Timeout"
# How long past a request's deadline the gateway still waits, so that a worker which reads the request after its
# deadline has passed answers `expired` (408 `expired`) before the gateway gives up on it (408 `timeout`).
EXPIRY_GRACE_S = 1.0


async def chat_completions(request: Request) -> Response:
    return await _answer(request, CHAT)


async def completions(request: Request) -> Response:
    return await _answer(request, COMPLETIONS)


@dataclass
class Call:
    """What is known of one HTTP call so far, for the error that may end it: how it named its token budget,
    whether it carried an `Idempotency-Key`, whether its submit began (a generation may exist from then on: see
    `once_submitted`) and its job once submitted (whose id the error's `X-Request-Id` carries)."""

    url: str
    idempotent: bool = False
    max_tokens_field: str = "max_tokens"
    submitting: bool = False
    job: AsyncJob | None = None


async def _answer(request: Request, url: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    started = time.monotonic()
    call = Call(url)
    try:
        return await _complete(gateway, request, call, started)
    except Exception as error:
        answer = from_exception(
            error, retry_after_s=gateway.settings.retry_after_s, url=url, max_tokens_field=call.max_tokens_field
        )
        if call.submitting:
            answer = once_submitted(answer, idempotent=call.idempotent)
        request_id = call.job.id if call.job is not None else None
        if answer.code == "internal":
            gateway.log.exception("request_failed", route=url, request_id=request_id)
        else:
            gateway.log.info(
                "request_refused",
                route=url,
                request_id=request_id,
                status=answer.status,
                code=answer.code,
                param=answer.param,
                retry=answer.retry,
            )
        return answer.response(request_id)


async def _complete(gateway: Gateway, request: Request, call: Call, started: float) -> Response:
    url = call.url
    body = await read_json(request, gateway.settings.max_body_bytes)
    asked = translate(body, url, echo_allowed=True)
    call.max_tokens_field = asked.max_tokens_field
    if not asked.model:
        raise APIError(400, "model is required", code="invalid_request", param="model")
    served = await gateway.models.served()
    queue = await gateway.models.queue_of(asked.model)
    if queue is None:
        raise unknown_model(asked.model, sorted(served))
    if asked.model in served:  # a served model's name, so a bounded label; a queue's name (accepted too) is none
        label_model(request.scope, asked.model)
    timeout = request_timeout(request.headers.get(TIMEOUT_HEADER), gateway.settings.request_timeout_s)
    request_id, call.idempotent = request_id_for(request.headers, bearer_token(request.headers.get("authorization")))
    call.submitting = True
    job = await gateway.client.submit(**asked.options, queue=queue, deadline=timeout, request_id=request_id)
    call.job = job
    answer = Answer(gateway, job, url, asked, started, timeout + EXPIRY_GRACE_S, idempotent=call.idempotent)
    try:
        if asked.stream:
            return await answer.stream(request)
        return await answer.whole(request)
    except ClientGone:
        await answer.abandon()
        answer.log_done(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except (RequestFailed, Cancelled):
        raise  # the request has ended: nothing to cancel
    except RedisUnavailable:
        await answer.abandon()  # a retry with its Idempotency-Key follows the same generation
        raise
    except BaseException:  # a timeout, the server stopping, a bug: leave nothing running
        await answer.cancel()
        raise


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refusing more than `limit` bytes (413) before reading them all."""
    try:
        body = json.loads(await read_body(request, limit))
    except ValueError:
        raise APIError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object.", code="invalid_json")
    return body


def request_timeout(header: str | None, default_s: float) -> float:
    """Seconds the request may take: `X-Request-Timeout` when given (at most `default_s`), else `default_s`.
    It is the deadline for a worker to start it (past it: 408 `expired`) and, with `EXPIRY_GRACE_S` more, the
    bound on waiting for its end (past it: 408 `timeout`, and the request is cancelled)."""
    if header is None:
        return default_s
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        message = f"{TIMEOUT_HEADER} must be a positive number of seconds"
        raise APIError(400, message, code="invalid_request", param=TIMEOUT_HEADER)
    return min(seconds, default_s)


class Answer:
    """One submitted request on its way back to the HTTP client."""

    def __init__(
        self,
        gateway: Gateway,
        job: AsyncJob,
        url: str,
        asked: Translated,
        started: float,
        timeout: float,  # the wait for its end
        *,
        idempotent: bool = False,
    ) -> None:
        self.gateway, self.job, self.url, self.asked = gateway, job, url, asked
        self.started, self.timeout, self.idempotent = started, timeout, idempotent
        self.model = asked.model or ""
        self.created = int(time.time())
        self.usage: tuple[int, int] | None = None

    async def whole(self, request: Request) -> Response:
        result = await unless_disconnected(request.receive, self.job.result(self.timeout))
        self.usage = (result.usage.prompt_tokens, result.usage.completion_tokens)
        self.log_done(200)
        return JSONResponse(
            completion_body(
                self.url,
                self.job.id,
                self.model,
                self.created,
                result.text,
                result.finish_reason,
                result.usage,
                result.logprobs,
                echo_of(self.asked, result.prompt_logprobs, result.prompt_tokens),
            ),
            headers={"X-Request-Id": self.job.id},
        )

    async def stream(self, request: Request) -> Response:
        deltas = self.job.stream(self.timeout)
        first = await unless_disconnected(request.receive, _next(deltas))
        self.gateway.metrics.ttft.labels(self.url, self.model).observe(time.monotonic() - self.started)
        return EventStream(self._events(first, deltas), headers={"X-Request-Id": self.job.id})

    async def _events(self, first: Delta | None, deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
        chunks = ChunkMaker(self.url, self.job.id, self.model, self.created)
        ended = False
        # An echo's prompt comes on the first chunk: the first delta, which scores it, has no tokens.
        echo = echo_of(self.asked, first.prompt_logprobs if first is not None else None)
        offset = len(echo.text) if echo is not None else 0
        try:
            yield event(chunks.text(first, first=True, echo=echo))
            offset += len(first.text) if first is not None else 0
            async for delta in deltas:
                if delta.text or delta.logprobs:
                    yield event(chunks.text(delta, offset=offset))
                    offset += len(delta.text)
            result = await self.job.result()  # at once: its stream has ended
            self.usage = (result.usage.prompt_tokens, result.usage.completion_tokens)
            yield event(chunks.finish(result.finish_reason))
            if self.asked.include_usage:
                yield event(chunks.usage(result.usage))
            ended = True
        except LLMQError as error:  # after the 200 was sent: the error is an event, which the SDKs raise
            if isinstance(error, ResultTimeout):
                await self.cancel()
            ended = True
            answer = from_exception(error, retry_after_s=0, url=self.url, max_tokens_field=self.asked.max_tokens_field)
            yield event(answer.body())
        finally:
            if not ended:  # the client went away (or the server is stopping)
                await self.abandon()
            self.log_done(200 if ended else CLIENT_CLOSED)
        yield DONE

    async def abandon(self) -> None:
        """The caller went away: stop generating, unless it sent an `Idempotency-Key`, whose retry is to follow
        this same generation (it runs to its end, within its `max_tokens`)."""
        if not self.idempotent:
            await self.cancel()

    async def cancel(self) -> None:
        """Ask the workers to stop the request; shielded, so a cancelled handler still sends it."""
        try:
            await asyncio.shield(self.job.cancel())
        except Exception as error:  # Redis away: the request's deadline still bounds a queued one
            self.gateway.log.warning("cancel_failed", request_id=self.job.id, error=str(error))

    def log_done(self, status: int) -> None:
        prompt, completion = self.usage or (None, None)
        self.gateway.log.info(
            "request",
            route=self.url,
            request_id=self.job.id,
            model=self.model,
            stream=self.asked.stream,
            status=status,
            prompt_tokens=prompt,
            completion_tokens=completion,
            duration_ms=round((time.monotonic() - self.started) * 1000, 1),
            user=self.asked.user,
        )


async def _next(deltas: AsyncIterator[Delta]) -> Delta | None:
    """The first delta, or None when the request finished without output (an error raises here)."""
    return await anext(deltas, None)
