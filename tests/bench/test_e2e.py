"""`bench/e2e.py`'s CPU meter: the shares it reports are the CPU each part used while measured, from `/proc`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.e2e import CpuMeter, thread_cpu_s

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_each_threads_cpu_is_counted_under_its_own_id() -> None:
    ids: list[int] = []
    spun = threading.Event()
    release = threading.Event()

    def busy() -> None:
        ids.append(threading.get_native_id())
        _spin(0.3)
        spun.set()
        release.wait(5)  # alive, so /proc still lists it

    before = thread_cpu_s(os.getpid())
    thread = threading.Thread(target=busy)
    thread.start()
    assert spun.wait(5)
    after = thread_cpu_s(os.getpid())
    release.set()
    thread.join()
    assert ids[0] not in before and after[ids[0]] >= 0.2  # it spun about 0.3 s of CPU
    assert after[os.getpid()] - before[os.getpid()] < 0.2  # the main thread waited


def test_the_meter_splits_a_workers_main_thread_from_its_others_and_counts_only_while_running() -> None:
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE
    )
    try:
        assert idle.stdout is not None and idle.stdout.readline() == b"ready\n"  # past its start-up's CPU
        meter = CpuMeter(client=os.getpid(), redis=idle.pid, worker=os.getpid())
        assert meter.shares() is None  # nothing measured yet
        meter.start()
        _spin(0.5)  # this thread is the "worker's main thread" and the client here
        meter.stop()
        _spin(0.3)  # not measured
        shares = meter.shares()
        assert shares is not None
        assert set(shares) == {"client", "redis", "worker_loop", "worker_engine"}
        assert 25 <= shares["worker_loop"] <= 110 and 25 <= shares["client"] <= 110  # it spun, on a loaded core or not
        assert shares["redis"] < 10 and shares["worker_engine"] < 20
    finally:
        idle.kill()
        idle.wait()
