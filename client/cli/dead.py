"""`llmq dead list | show | replay | drop`: the queue's dead letters, for an operator. Reading and writing them is
`client.dead_letters`; this module only says what happened."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from typing import Any

from client.cli.context import Context
from client.cli.exits import Exit, NotFound
from client.cli.output import note, warn
from client.dead_letters import DeadLetter, DeadLetters, NotReplayable
from client.protocol import ms_now


def _age(ms: int) -> str:
    seconds = ms / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _summary(letter: DeadLetter) -> dict[str, Any]:
    return {
        "id": letter.id,
        "partition": letter.partition,
        "entry_id": letter.entry_id,
        "request_id": letter.request_id,
        "reason": letter.reason,
        "age_s": letter.age_ms / 1000,
        "raw_bytes": len(letter.raw),
    }


def listing(context: Context) -> Exit:
    args = context.args
    letters = DeadLetters(context.admin, context.queue)
    shown = letters.oldest(args.limit)
    if args.json:
        for letter in shown:
            print(json.dumps(_summary(letter)))
        return Exit.OK
    total = letters.count()
    print(f"queue {context.queue}: {total} dead letters" + (f", the oldest {len(shown)}:" if shown else ""))
    several = context.admin.partitions > 1  # then two letters may share an entry id: the partition tells them apart
    for letter in shown:
        where = f"partition {letter.partition}  " if several else ""
        print(f"  {letter.id}  {where}{letter.request_id or '-'}  {_age(letter.age_ms)} ago  {letter.reason}")
    if total > len(shown):
        note(f"{total - len(shown)} more: raise --limit to see them")
    return Exit.OK


def _one(context: Context, letters: DeadLetters) -> DeadLetter:
    letter = letters.find(context.args.id)
    if letter is None:
        raise NotFound(f"no dead letter {context.args.id!r} on queue {context.queue!r} (`llmq dead list` shows them)")
    return letter


def show(context: Context) -> Exit:
    letter = _one(context, DeadLetters(context.admin, context.queue))
    request = None if letter.request is None else letter.request.model_dump(mode="json", exclude_none=True)
    if context.args.json:
        raw = {"raw_hex": letter.raw.hex()} if request is None else {}
        print(json.dumps({**_summary(letter), "request": request, **raw}))
        return Exit.OK
    print(f"dead letter {letter.id} (partition {letter.partition}), {_age(letter.age_ms)} ago")
    print(f"  from request entry {letter.entry_id or '-'}")
    print(f"  reason: {letter.reason}")
    if request is None:
        print(f"  entry: {len(letter.raw)} bytes, not a readable request (it cannot be replayed)")
    else:
        print(f"  request: {json.dumps(request, ensure_ascii=False)}")
    return Exit.OK


def _chosen(context: Context, letters: DeadLetters) -> Iterator[DeadLetter]:
    """The letter named, or with --all every letter there is (at most --limit)."""
    if not context.args.all:
        return iter([_one(context, letters)])
    return islice(letters.every(), context.args.limit)


def replay(context: Context) -> Exit:
    args = context.args
    letters = DeadLetters(context.admin, context.queue)
    replayed = skipped = 0
    for letter in _chosen(context, letters):
        try:
            moved = letters.replay(letter, args.priority)
        except NotReplayable as error:
            if not args.all:
                raise
            note(f"skipped: {error}")
            skipped += 1
            continue
        if not moved and not args.all:
            raise NotFound(f"dead letter {letter.id} is gone: replayed or dropped meanwhile")
        if moved:
            replayed += 1
            print(f"replayed {letter.request_id} (dead letter {letter.id}) to lane {args.priority}")
            _warn_if_expired(letter)
    if args.all:
        skips = f", skipped {skipped} (no readable request: `llmq dead drop ID` removes one)" if skipped else ""
        print(f"replayed {replayed} dead letter{'s' * (replayed != 1)}{skips}")
    return Exit.FAILED if skipped else Exit.OK


def _warn_if_expired(letter: DeadLetter) -> None:
    deadline = None if letter.request is None else letter.request.deadline
    if deadline is not None and deadline <= ms_now():
        warn(f"request {letter.request_id}'s deadline has passed: a worker will answer it `expired`")


def drop(context: Context) -> Exit:
    args = context.args
    letters = DeadLetters(context.admin, context.queue)
    if args.all and args.limit is None:
        print(_dropped(letters.drop_all()))
        return Exit.OK
    dropped = 0
    for letter in _chosen(context, letters):
        if letters.drop(letter):
            dropped += 1
        elif not args.all:
            raise NotFound(f"dead letter {letter.id} is gone: replayed or dropped meanwhile")
    print(_dropped(dropped))
    return Exit.OK


def _dropped(count: int) -> str:
    return f"dropped {count} dead letter{'s' * (count != 1)}"
