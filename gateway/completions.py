"""`POST /v1/chat/completions` and `POST /v1/completions`: an OpenAI body becomes queued requests
(`AsyncClient.submit`), one per choice (`n`), whose answer is returned whole or streamed as server-sent events.

A streamed answer's headers wait for the first token of every choice (which the client waits for anyway), so
every error known by then, an expired deadline or a request the worker refused included, still gets its HTTP
status; a later one arrives as an error event before `data: [DONE]`, which the OpenAI SDKs raise. A client that
goes away cancels its requests (`AsyncJob.cancel`: the worker stops each within one engine step); so does a call
that outlives its timeout, and an error in one of `n` choices cancels the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from client import AsyncChoices, AsyncJob, Delta, LLMQError, RequestFailed, ResultTimeout
from client.errors import Cancelled, RedisUnavailable
from client.openai_format import (
    CHAT,
    COMPLETIONS,
    Translated,
    choice_body,
    choices_body,
    echo_of,
    translate,
)
from client.protocol import Usage, choice_ids, total_usage
from gateway.auth import bearer_token, tenant_of
from gateway.bodies import read_json
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
T = TypeVar("T")


async def chat_completions(request: Request) -> Response:
    return await _answer(request, CHAT)


async def completions(request: Request) -> Response:
    return await _answer(request, COMPLETIONS)


@dataclass
class Call:
    """What is known of one HTTP call so far, for the error that may end it: how it named its token budget,
    whether it carried an `Idempotency-Key`, whether its submit began (a generation may exist from then on: see
    `once_submitted`) and its id once it submits (which the error's `X-Request-Id` carries)."""

    url: str
    idempotent: bool = False
    max_tokens_field: str = "max_tokens"
    submitting: bool = False
    request_id: str | None = None


async def _answer(request: Request, url: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    started = time.monotonic()
    call = Call(url)
    try:
        return await _complete(gateway, request, call, started)
    except Exception as error:
        answer = from_exception(
            error,
            retry_after_s=gateway.settings.retry_after_for(error),
            url=url,
            max_tokens_field=call.max_tokens_field,
        )
        if call.submitting:
            answer = once_submitted(answer, idempotent=call.idempotent)
        request_id = call.request_id
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
    asked = translate(body, url, echo_allowed=True, n_allowed=True)
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
    api_key = bearer_token(request.headers.get("authorization"))
    request_id, call.idempotent = request_id_for(request.headers, api_key, url)
    call.submitting = True
    jobs: list[AsyncJob] = []
    answer = Answer(
        gateway, request_id, jobs, url, asked, started, timeout + EXPIRY_GRACE_S, idempotent=call.idempotent
    )
    try:
        job = await gateway.client.submit(
            **asked.options,
            n=asked.n,
            queue=queue,
            deadline=timeout,
            request_id=request_id,
            tenant=tenant_of(request.scope),
        )
    except BaseException:  # a full queue, Redis away: a retry with its Idempotency-Key submits the rest
        if asked.n > 1:  # choices before the one refused may run: errors name the call, and stop them unless kept
            call.request_id = request_id
            choices = choice_ids(request_id, asked.n)
            jobs.extend(AsyncJob.attach(gateway.client, choice, queue=queue) for choice in choices)
            await answer.abandon()
        raise
    jobs.extend(job.jobs if isinstance(job, AsyncChoices) else [job])
    call.request_id = request_id  # a generation exists: errors from now on name the call
    try:
        if asked.stream:
            return await answer.stream(request)
        return await answer.whole(request)
    except ClientGone:
        await answer.abandon()
        answer.log_done(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except (RequestFailed, Cancelled):
        if len(jobs) > 1:  # one choice has ended: stop the others
            await answer.cancel()
        raise
    except RedisUnavailable:
        await answer.abandon()  # a retry with its Idempotency-Key follows the same generation
        raise
    except BaseException:  # a timeout, the server stopping, a bug: leave nothing running
        await answer.cancel()
        raise


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
    """One call's submitted requests (one per choice, filled in as they are submitted) on their way back to the
    HTTP client."""

    def __init__(
        self,
        gateway: Gateway,
        request_id: str,  # the call's: the answer's `id` and `X-Request-Id`
        jobs: list[AsyncJob],
        url: str,
        asked: Translated,
        started: float,
        timeout: float,  # the wait for its end
        *,
        idempotent: bool = False,
    ) -> None:
        self.gateway, self.request_id, self.jobs, self.url, self.asked = gateway, request_id, jobs, url, asked
        self.started, self.timeout, self.idempotent = started, timeout, idempotent
        self.model = asked.model or ""
        self.created = int(time.time())
        self.usage: tuple[int, int] | None = None

    async def whole(self, request: Request) -> Response:
        results = await unless_disconnected(request.receive, _all(job.result(self.timeout) for job in self.jobs))
        usage = total_usage([result.usage for result in results])
        self.usage = (usage.prompt_tokens, usage.completion_tokens)
        self.log_done(200)
        choices = [
            choice_body(
                self.url,
                index,
                result.text,
                result.finish_reason,
                result.logprobs,
                echo_of(self.asked, result.prompt_logprobs, result.prompt_tokens),
                result.tool_calls,
            )
            for index, result in enumerate(results)
        ]
        return JSONResponse(
            choices_body(self.url, self.request_id, self.model, self.created, choices, usage),
            headers={"X-Request-Id": self.request_id},
        )

    async def stream(self, request: Request) -> Response:
        streams = [job.stream(self.timeout) for job in self.jobs]
        firsts = await unless_disconnected(request.receive, _all(_next(deltas) for deltas in streams))
        self.gateway.metrics.ttft.labels(self.url, self.model).observe(time.monotonic() - self.started)
        return EventStream(self._events(firsts, streams), headers={"X-Request-Id": self.request_id})

    async def _events(self, firsts: list[Delta | None], streams: list[AsyncIterator[Delta]]) -> AsyncIterator[bytes]:
        chunks = ChunkMaker(self.url, self.request_id, self.model, self.created)
        ended = False
        offsets: list[int] = []  # each choice's text streamed so far (completions count `text_offset` from it)
        usages: list[Usage] = []
        try:
            for index, first in enumerate(firsts):
                echo = echo_of(self.asked, *((first.prompt_logprobs, first.prompt_tokens) if first else (None, None)))
                echoed = len(echo.text) if echo is not None else 0
                if echo is not None:  # the prompt comes alone on its choice's first chunk, with its scores if asked
                    yield event(chunks.text(None, first=True, echo=echo, index=index))
                if echo is None or (first is not None and (first.text or first.logprobs)):  # an unscored echo's
                    yield event(chunks.text(first, first=echo is None, offset=echoed, index=index))  # first tokens
                offsets.append(echoed + (len(first.text) if first else 0))
            async with contextlib.aclosing(_merged(streams)) as merged:  # closed here, its waits with it
                async for index, delta in merged:
                    if delta is None:  # this choice's stream has ended
                        result = await self.jobs[index].result()  # at once
                        usages.append(result.usage)
                        yield event(chunks.finish(result.finish_reason, index, called=bool(result.tool_calls)))
                    elif delta.text or delta.logprobs or delta.tool_calls:
                        yield event(chunks.text(delta, offset=offsets[index], index=index))
                        offsets[index] += len(delta.text)
            usage = total_usage(usages)
            self.usage = (usage.prompt_tokens, usage.completion_tokens)
            if self.asked.include_usage:
                yield event(chunks.usage(usage))
            ended = True
        except LLMQError as error:  # after the 200 was sent: the error is an event, which the SDKs raise
            if isinstance(error, ResultTimeout) or len(self.jobs) > 1:  # stop what still runs
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
        these same generations (they run to their end, within their `max_tokens`)."""
        if not self.idempotent:
            await self.cancel()

    async def cancel(self) -> None:
        """Ask the workers to stop the requests; shielded, so a cancelled handler still sends it."""
        try:
            await asyncio.shield(asyncio.gather(*(job.cancel() for job in self.jobs)))
        except Exception as error:  # Redis away: the requests' deadline still bounds a queued one
            self.gateway.log.warning("cancel_failed", request_id=self.request_id, error=str(error))

    def log_done(self, status: int) -> None:
        prompt, completion = self.usage or (None, None)
        self.gateway.log.info(
            "request",
            route=self.url,
            request_id=self.request_id,
            model=self.model,
            stream=self.asked.stream,
            n=self.asked.n,
            status=status,
            prompt_tokens=prompt,
            completion_tokens=completion,
            duration_ms=round((time.monotonic() - self.started) * 1000, 1),
            user=self.asked.user,
        )


async def _next(items: AsyncIterator[T]) -> T | None:
    """The next item (a request's next delta), or None at the end (a request finished without more output; an
    error raises here)."""
    return await anext(items, None)


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first error raises at once, and the waits still running are cancelled (the
    requests behind them are the caller's to cancel)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for those done


async def _merged(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T | None], None]:
    """The items of `streams` as they come, each with its stream's index, and `(index, None)` when that stream
    ends; an error in any raises here, and the waits on the others are cancelled."""
    waits = {asyncio.ensure_future(_next(stream)): index for index, stream in enumerate(streams)}
    try:
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in sorted(done, key=waits.__getitem__):
                index = waits.pop(wait)
                item = wait.result()
                if item is not None:
                    waits[asyncio.ensure_future(_next(streams[index]))] = index
                yield index, item
    finally:
        for wait in waits:
            wait.cancel()
