"""Keeps the engine thread's OpenMP workers the only ones in the process, so its parallel regions stay quick.

torch (and oneDNN, and the native kernels) run their parallel regions on GNU OpenMP (libgomp), which keeps a team of
worker threads for every thread that ever ran a region. The engine's steps run in the library's own thread, but the
model is loaded, packed and given its cache in others (the loading thread, the one that starts the library), and
their idle teams stay. Once libgomp manages more threads than the process has CPUs, it lets an idle worker spin only
about a hundred times before it sleeps, so every region of every step wakes its workers from sleep: measured on
SmolLM2, 2 cores (`python -m bench.openmp_teams`), the busy workload ran 1.09x faster without the idle teams and a
lone token 1.12x, and the float32 few-row kernel's products took 21 ms a token instead of 37.
`release_idle_threads()`, called on a thread when it has done its torch work, ends that thread's team
(`omp_pause_resource_all`, OpenMP 5.0) and leaves the engine's alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: the threads end (soft would keep them)


@functools.cache
def _libgomp() -> Any | None:
    """libgomp as torch loaded it (never a second copy: RTLD_NOLOAD), where it has `omp_pause_resource_all` (GCC 9
    on); None where torch runs another OpenMP (Intel's, LLVM's: they do not throttle this way) or none."""
    try:
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD on this platform
        return None
    pause = getattr(library, "omp_pause_resource_all", None)
    if pause is None:
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_idle_threads() -> bool:
    """Ends the calling thread's idle OpenMP workers (its next parallel region starts new ones). For a thread that
    has run torch work and will not run the engine's steps: after loading a model, after starting the library.
    True where a team was ended or there was none; False where this runtime cannot (or the thread is inside a
    parallel region)."""
    pause = _libgomp()
    return pause is not None and pause(_OMP_PAUSE_HARD) == 0
