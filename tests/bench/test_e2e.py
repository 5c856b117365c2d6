"""`bench/e2e.py`'s CPU meter: the shares it reports are the CPU each part used while measured, from `/proc`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.e2e import CpuMeter
from bench.workload import cpu_s

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")


def _spin(cpu_seconds: float) -> None:
    """Until this thread has used `cpu_seconds` of CPU, however loaded the machine."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_a_process_counts_its_ended_threads_and_a_thread_its_own() -> None:
    process = Path(f"/proc/{os.getpid()}/stat")
    main = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/stat")
    before, main_before = cpu_s(process), cpu_s(main)
    thread = threading.Thread(target=_spin, args=(0.3,))
    thread.start()
    thread.join()  # ended: only the process's count keeps its CPU
    assert cpu_s(process) - before >= 0.25
    assert cpu_s(main) - main_before < 0.15  # the main thread waited


def test_the_meter_splits_a_workers_main_thread_from_its_others_and_counts_only_while_running() -> None:
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE
    )
    try:
        assert idle.stdout is not None and idle.stdout.readline() == b"ready\n"  # past its start-up's CPU
        meter = CpuMeter(client=os.getpid(), redis=idle.pid, worker=os.getpid())
        assert meter.shares() is None  # nothing measured yet
        meter.start()
        wall, cpu = time.perf_counter(), time.thread_time()
        _spin(0.3)  # this thread is the worker's main thread and the client here
        expected = 100 * (time.thread_time() - cpu) / (time.perf_counter() - wall)
        meter.stop()
        _spin(0.3)  # not measured
        shares = meter.shares()
        assert shares is not None
        assert set(shares) == {"client", "redis", "worker_loop", "worker_engine"}
        # /proc counts in ticks of 10 ms: within a few of 0.3 s
        assert abs(shares["worker_loop"] - expected) <= 15 and abs(shares["client"] - expected) <= 15
        assert shares["redis"] < 10 and shares["worker_engine"] < 20
    finally:
        idle.kill()
        idle.wait()
