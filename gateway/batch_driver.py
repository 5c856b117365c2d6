"""The gateway's background task that runs batches: it takes the lease of each unfinished batch no gateway holds
(up to `batch_max_running` at once), and drives it through `validating`, `in_progress` and `finalizing` to an
end: `completed`, `failed`, `expired` or `cancelled`.

A batch is driven by one gateway at a time: the lease (`batch_lease_s`) is renewed while it runs and released on a
clean stop; a gateway that dies lets it expire, and another (or the restarted one) takes the batch over where it
was. Its lines run exactly once however often that happens: their request ids derive from the batch and their
`custom_id` (`client.batch`), so submitting a line again follows the first submission, and each answer is written
once (`BatchStore.answer`). Lines run on the `batch` lane (a line's `service_tier` wins), `batch_window` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from structlog.typing import FilteringBoundLogger

from client import AsyncClient, AsyncJob
from client.batch import Line, output_line
from gateway.batch_lines import check, expired, identity_of, runnable
from gateway.batch_store import ENDED, BatchStore
from gateway.models import ModelDirectory
from gateway.settings import GatewaySettings

END_ATTEMPTS = 5  # tries at writing a batch's files (each a takeover after a failure) before it fails instead


class LeaseLost(Exception):
    """Another gateway holds the batch now: stop driving it, write nothing more."""


class BatchDriver:
    def __init__(
        self,
        store: BatchStore,
        client: AsyncClient,
        models: ModelDirectory,
        settings: GatewaySettings,
        log: FilteringBoundLogger,
    ) -> None:
        self.store, self.client, self.models, self.settings, self.log = store, client, models, settings, log
        self.token = secrets.token_hex(8)  # this gateway, as a lease holder
        self.driving: dict[str, asyncio.Task[None]] = {}

    async def run_forever(self) -> None:
        """Looks for batches to drive every `batch_poll_s`, until cancelled (then lets go of them)."""
        failing = False
        try:
            while True:
                try:
                    await self._adopt()
                    failing = False
                except Exception as error:  # Redis away: try again next round (logged once per outage)
                    if not failing:
                        self.log.warning("batch_scan_failed", error=repr(error))
                    failing = True
                await asyncio.sleep(self.settings.batch_poll_s)
        finally:
            for task in self.driving.values():
                task.cancel()
            await asyncio.gather(*self.driving.values(), return_exceptions=True)

    async def _adopt(self) -> None:
        for batch_id in await self.store.to_drive():
            if len(self.driving) >= self.settings.batch_max_running:
                return
            if batch_id in self.driving:
                continue
            if await self.store.batch(None, batch_id) is None:  # expired, or never fully written
                await self.store.finished(batch_id)
            elif await self.store.take_lease(batch_id, self.token, self.settings.batch_lease_s):
                task = asyncio.create_task(self._drive(batch_id))
                self.driving[batch_id] = task
                task.add_done_callback(functools.partial(self._forget, batch_id))

    def _forget(self, batch_id: str, _: asyncio.Task[None]) -> None:
        self.driving.pop(batch_id, None)

    async def _drive(self, batch_id: str) -> None:
        run = BatchRun(self, batch_id)
        work = asyncio.create_task(run.work())
        try:
            await self._watch(run, work)
        except LeaseLost:
            self.log.warning("batch_lease_lost", batch_id=batch_id)
        except Exception:
            self.log.exception("batch_failed", batch_id=batch_id)
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.release_lease(batch_id, self.token))

    async def _watch(self, run: BatchRun, work: asyncio.Task[None]) -> None:
        """Renews the lease while `work` runs; stops its lines when the batch is cancelled or its window ends."""
        every = min(self.settings.batch_lease_s / 3, self.settings.batch_poll_s)
        while True:
            await asyncio.wait({work}, timeout=every)
            if work.done():
                return work.result()
            if not await self.store.renew_lease(run.batch_id, self.token, self.settings.batch_lease_s):
                raise LeaseLost(run.batch_id)
            record = await self.store.batch(None, run.batch_id)
            if record is None:
                return None
            if run.running and (record["status"] == "cancelling" or time.time() >= record["expires_at"]):
                await run.stop_lines(cancel=True)  # past the window too: lines in flight would only be answered late


class BatchRun:
    """One batch, from wherever it stands to its end (each step can be redone after a crash)."""

    def __init__(self, driver: BatchDriver, batch_id: str) -> None:
        self.driver, self.store, self.batch_id = driver, driver.store, batch_id
        self.identity = identity_of(batch_id)
        self.lines: asyncio.Task[None] | None = None
        self.in_flight: dict[int, Line] = {}  # by submit_many's index
        self.queue: str | None = None

    @property
    def running(self) -> bool:
        return self.lines is not None and not self.lines.done()

    async def work(self) -> None:
        record = await self.store.batch(None, self.batch_id)
        if record is None or record["status"] in ENDED:
            await self.store.finished(self.batch_id)
            return
        if record["status"] == "validating" and time.time() >= record["expires_at"]:
            await self._end(record, "expired")  # never validated: no line ran, no answer to write
            return
        if record["status"] == "validating" and not await self.driver.models.served():
            return  # no worker alive (yet): validated in a later round, without reading the file now
        data = await self.store.file_data(record["input_file_id"])
        if data is None:  # deleted before `DELETE /v1/files` refused it: ends with what was answered
            if record["status"] == "cancelling":
                await self._end(record, "cancelled")
            else:
                await self._fail(record, "input_file_missing", "The input file no longer exists.")
            return
        if record["status"] == "validating":
            validated = await self._validate(record, data)
            if validated is None:  # failed, or to validate again later
                return
            record = validated
        if record["status"] == "in_progress" and time.time() < record["expires_at"]:
            self.lines = asyncio.create_task(self._run_lines(record, data))
            try:
                await asyncio.wait({self.lines})  # it ends by itself, or is stopped (`stop_lines`)
            finally:
                if not self.lines.done():  # this run is stopped (lease lost, gateway stopping): its lines stop with it
                    self.lines.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self.lines
            if not self.lines.cancelled():
                self.lines.result()  # raises what failed it: the batch is retried later
        await self._finish(data)

    async def _validate(self, record: dict[str, Any], data: bytes) -> dict[str, Any] | None:
        settings = self.driver.settings
        checked = await asyncio.to_thread(check, data, self.identity, record["endpoint"], settings.batch_max_lines)
        if checked.errors:
            await self._fail(record, None, None, checked.errors)
            return None
        if checked.model is not None and await self._queue_of(checked.model) is None:
            served = sorted(await self.driver.models.served())
            if not served:  # the workers left while the file was read: validated again in a later round
                return None
            message = f"The model {checked.model!r} does not exist. Served: {', '.join(served)}."
            await self._fail(record, "model_not_found", message)
            return None
        for start in range(0, len(checked.refused), 500):
            await self.store.answer(self.batch_id, checked.refused[start : start + 500])

        def started(now: dict[str, Any]) -> dict[str, Any] | None:
            if now["status"] != "validating":
                return None
            counts = {"total": checked.total, "completed": 0, "failed": 0}
            return {"status": "in_progress", "in_progress_at": int(time.time()), "model": checked.model,
                    "request_counts": counts}  # fmt: skip

        return await self.store.update(self.batch_id, started)

    async def _queue_of(self, model: str) -> str | None:
        self.queue = await self.driver.models.queue_of(model)
        return self.queue

    async def _run_lines(self, record: dict[str, Any], data: bytes) -> None:
        answered = await self.store.answered(self.batch_id)
        model = record["model"] or ""
        while record["model"] and await self._queue_of(model) is None:  # its workers are away: wait for them
            await asyncio.sleep(self.driver.settings.batch_poll_s)
        deadline = datetime.fromtimestamp(record["expires_at"], UTC)  # past it, workers answer `expired`
        indexes = itertools.count()

        def requests() -> Iterator[dict[str, Any]]:
            for line in runnable(data, self.identity, answered):
                self.in_flight[next(indexes)] = line  # submit_many numbers the requests in the order they are read
                yield {
                    "priority": "batch",
                    **line.options,
                    "queue": self.queue,
                    "deadline": deadline,
                    "tenant": record.get("_tenant"),  # None (the default tenant) for a batch of the last release
                }

        client = self.driver.client
        async for outcome in client.submit_many(requests(), window=self.driver.settings.batch_window):
            line = self.in_flight.pop(outcome.index)
            text = output_line(line, model, outcome.result, outcome.error)
            await self.store.answer(self.batch_id, [(line.custom_id or "", text, outcome.error is None)])

    async def stop_lines(self, *, cancel: bool) -> None:
        """Stops following the lines; `cancel`: also asks the workers to stop those in flight."""
        if self.lines is not None:
            self.lines.cancel()
        if cancel:
            for line in list(self.in_flight.values()):
                for request_id in line.request_ids:
                    with contextlib.suppress(Exception):
                        await AsyncJob.attach(self.driver.client, request_id, queue=self.queue).cancel()

    async def _finish(self, data: bytes) -> None:
        record = await self.store.batch(None, self.batch_id)
        if record is None or record["status"] in ENDED:
            await self.store.finished(self.batch_id)
            return
        completed, failed = await self.store.counts(self.batch_id)
        if record["status"] == "cancelling":
            final = "cancelled"
        elif record["status"] != "finalizing" and time.time() >= record["expires_at"]:
            # before the count: lines the workers answered `expired` fill it too, and the batch did not complete
            final = "expired"
            answered = await self.store.answered(self.batch_id)
            late = await asyncio.to_thread(expired, data, self.identity, record["model"] or "", answered)
            for start in range(0, len(late), 500):
                await self.store.answer(self.batch_id, late[start : start + 500])
        elif completed + failed >= record["request_counts"]["total"]:
            final = "completed"
            await self.store.update(self.batch_id, _finalizing)
        else:
            return  # stopped early (the gateway is stopping): the next driver goes on
        await self._end(record, final)

    async def _end(self, record: dict[str, Any], final: str, errors: list[dict[str, Any]] | None = None) -> None:
        """Writes the output and error files (what was answered) and ends the batch `final` (`cancelled` if a
        cancel came first; `failed` with `errors`)."""
        counted = await self.store.update(self.batch_id, _an_end_attempt)
        if counted is None or counted["status"] in ENDED:
            await self.store.finished(self.batch_id)
            return
        files: dict[str, str] = {}
        if counted["_end_attempts"] > END_ATTEMPTS:  # writing the files failed each time (logged): given up
            self.driver.log.error("batch_files_abandoned", batch_id=self.batch_id)
            final = "failed"
            errors = [_error("finalize_failed", "The batch's output and error files could not be written.")]
        else:
            files, too_large = await self._write_files(record)
            if too_large:
                final, errors = "failed", [*(errors or []), *too_large]

        def ended(now: dict[str, Any]) -> dict[str, Any] | None:
            if now["status"] in ENDED:
                return None
            end = "cancelled" if now["status"] == "cancelling" else final
            fields = {"status": end, f"{end}_at": int(time.time()), **files}
            return fields | {"errors": {"object": "list", "data": errors}} if end == "failed" and errors else fields

        await self.store.update(self.batch_id, ended)
        await self.store.finished(self.batch_id)
        self.driver.log.info("batch_ended", batch_id=self.batch_id, status=final)

    async def _write_files(self, record: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Writes the output and error files of what was answered: their ids, and the errors of those too large."""
        files: dict[str, str] = {}
        too_large = []
        most = self.driver.settings.batch_output_max_bytes
        for succeeded, name in ((True, "output"), (False, "error")):
            content = await self.store.answers(self.batch_id, succeeded, most)
            if content is None:
                message = f"The batch's {name} file would exceed {most} bytes (batch_output_max_bytes)."
                too_large.append(_error("output_too_large", message))
            elif content:
                filename = f"{self.batch_id}_{name}.jsonl"
                await self.store.put_file(record["_owner"], filename, "batch_output", content, record[f"_{name}_file"])
                files[f"{name}_file_id"] = record[f"_{name}_file"]
        return files, too_large

    async def _fail(
        self, record: dict[str, Any], code: str | None, message: str | None, errors: list[dict[str, Any]] | None = None
    ) -> None:
        await self._end(record, "failed", errors if errors is not None else [_error(code, message)])


def _error(code: str | None, message: str | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None}


def _an_end_attempt(record: dict[str, Any]) -> dict[str, Any] | None:
    return None if record["status"] in ENDED else {"_end_attempts": record.get("_end_attempts", 0) + 1}


def _finalizing(record: dict[str, Any]) -> dict[str, Any] | None:
    return {"status": "finalizing", "finalizing_at": int(time.time())} if record["status"] == "in_progress" else None
