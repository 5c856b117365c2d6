"""`openmp.release_idle_threads`: a thread that ran torch's parallel work ends its idle OpenMP team (the engine's
steps run in the library's thread, whose team must be libgomp's only one to stay quick), and the loader and the
engine's start call it in the threads they run in."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine import openmp
from worker.engine.loader import LoadOptions, load_model

needs_threads = pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here: no team to end")


def process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def in_a_thread(work: Any) -> Any:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(work()))
    thread.start()
    thread.join()
    return results[0]


@needs_threads
def test_a_thread_that_ran_parallel_work_ends_its_team() -> None:
    """A parallel region in a new thread leaves workers behind (libgomp keeps them for its next region); released,
    they end, and the next region starts them again."""

    def work() -> tuple[int, bool, int, int]:
        before = process_threads()
        torch.ones(4096, 4096).sum()  # a region over both threads
        kept = process_threads()
        released = openmp.release_idle_threads()
        after = process_threads()
        torch.ones(4096, 4096).sum()
        return before, released, kept, after

    before, released, kept, after = in_a_thread(work)
    assert released
    assert kept > before, "the region's workers stay after it"
    assert after == before, (before, kept, after)


def test_releasing_without_a_team_or_twice_is_harmless() -> None:
    assert in_a_thread(openmp.release_idle_threads) is True
    assert openmp.release_idle_threads() is True and openmp.release_idle_threads() is True


async def test_the_loader_and_the_engine_start_release_their_threads_teams(
    tiny_model_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both call it in the thread that did the work (the loader's caller's, the start's worker thread), never in the
    library's generation thread, which keeps its team for the steps."""
    callers: list[str] = []

    def release() -> bool:
        callers.append(threading.current_thread().name)
        return True

    monkeypatch.setattr(openmp, "release_idle_threads", release)
    model, tokenizer = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache"))
    assert callers == [threading.current_thread().name]
    await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert len(callers) == 2 and callers[1] != threading.current_thread().name  # the start's worker thread
    assert all("generation" not in name for name in callers)
