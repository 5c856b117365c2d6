"""A test-only way to make one request kill the engine thread: while `install`ed, the engine's sampler raises
inside the library's thread whenever a row of the step carries `POISON_TOP_P`, the way a value the library
cannot sample with once did. Every other request in that step is innocent, and the step fails all the same.

`python -m testing.poison` runs a worker (same flags as `llmq-worker`) with the poison installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from worker.engine.sampling import FusedSampler

POISON_TOP_P = 0.4375  # exact in float32; no test asks for it otherwise


def poisoned(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def sample_or_die(self: FusedSampler, input_ids: torch.Tensor, scores: torch.Tensor, args: torch.Tensor) -> Any:
        top_p = args[self._top_p_row, : scores.size(0)].view(torch.float32)
        if bool((top_p == POISON_TOP_P).any()):
            raise RuntimeError("a poisoned request is in this step")
        return call(self, input_ids, scores, args)

    return sample_or_die


def install() -> None:
    FusedSampler.__call__ = poisoned(FusedSampler.__call__)  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from worker.__main__ import main

    main(sys.argv[1:])
