"""The engine against `model.generate`, on tiny random models loaded through `from_pretrained`."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import load, reference_greedy
from tests.polling import wait_until
from worker.engine.errors import EngineFailed, RequestRejected
from worker.engine.types import EngineRequest, Finish, GenerationParams, OutputDelta, Resume


def greedy(max_new_tokens: int, **kwargs: Any) -> GenerationParams:
    return GenerationParams(max_new_tokens=max_new_tokens, temperature=0, **kwargs)


def mixed_prompts(vocab: int, count: int = 16, seed: int = 1) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) of mixed lengths; ids avoid the three special tokens."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))], rng.randint(1, 40)) for _ in range(count)]


async def collect(stream: Any) -> list[OutputDelta]:
    return [delta async for delta in stream]


def tokens_of(deltas: list[OutputDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


def text_of(deltas: list[OutputDelta]) -> str:
    return "".join(delta.text for delta in deltas)


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "staggered"])
async def test_greedy_matches_generate(tiny_model_dir: Path, make_engine: Any, staggered: bool) -> None:
    reference_model, _ = load(tiny_model_dir)
    engine = await make_engine(tiny_model_dir)
    workload = mixed_prompts(engine.vocab_size, count=18)
    expected = [reference_greedy(reference_model, ids, n) for ids, n in workload]

    streams = []
    for index, (ids, n) in enumerate(workload):
        streams.append(
            asyncio.ensure_future(collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n)))))
        )
        if staggered:  # later requests join a batch that is already decoding
            await asyncio.sleep(0.02 * (index % 4))
    results = await asyncio.gather(*streams)

    for index, deltas in enumerate(results):
        assert tokens_of(deltas) == expected[index], f"request {index}"
        assert [d.finish_reason for d in deltas].count(None) == len(deltas) - 1
        assert deltas[-1].finish_reason in (Finish.EOS, Finish.LENGTH)
    assert engine.stats().decode_tokens >= sum(len(e) for e in expected) - len(expected)


async def test_sampled_and_greedy_share_a_batch(llama_dir: Path, make_engine: Any) -> None:
    reference_model, _ = load(llama_dir)
    engine = await make_engine(llama_dir)
    workload = mixed_prompts(engine.vocab_size, count=8, seed=7)
    sampled = [
        engine.submit(
            EngineRequest(
                f"s{i}", input_ids=ids, params=GenerationParams(max_new_tokens=n, temperature=1.3, top_p=0.9, top_k=40)
            )
        )
        for i, (ids, n) in enumerate(workload)
    ]
    greedy_streams = [
        engine.submit(EngineRequest(f"g{i}", input_ids=ids, params=greedy(n))) for i, (ids, n) in enumerate(workload)
    ]
    greedy_out = await asyncio.gather(*(collect(s) for s in greedy_streams))
    sampled_out = await asyncio.gather(*(collect(s) for s in sampled))
    for (ids, n), deltas in zip(workload, greedy_out, strict=True):
        assert tokens_of(deltas) == reference_greedy(reference_model, ids, n)
    assert all(deltas[-1].finished for deltas in sampled_out)
    assert sum(len(tokens_of(d)) for d in sampled_out) > 0


async def test_prompt_and_chat_messages(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    tokenizer = engine.tokenizer
    by_prompt = engine.submit(EngineRequest("p", prompt="The quick brown fox", params=greedy(8)))
    by_ids = engine.submit(
        EngineRequest("i", input_ids=tokenizer("The quick brown fox")["input_ids"], params=greedy(8))
    )
    chat = engine.submit(EngineRequest("c", messages=[{"role": "user", "content": "hi 😀"}], params=greedy(8)))
    prompt_out, ids_out, chat_out = await asyncio.gather(collect(by_prompt), collect(by_ids), collect(chat))
    assert tokens_of(prompt_out) == tokens_of(ids_out)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi 😀"}], add_generation_prompt=True, tokenize=False
    )
    assert chat_out[-1].prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


async def test_stop_string_ends_stream_without_it(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    ids = [5, 6, 7, 8]
    full = text_of(
        await collect(engine.submit(EngineRequest("full", input_ids=ids, params=greedy(30, ignore_eos=True))))
    )
    assert len(full) > 6
    stop = full[3:6]
    cut = full.find(stop)
    deltas = await collect(
        engine.submit(EngineRequest("stopped", input_ids=ids, params=greedy(30, stop=(stop, "never-seen"))))
    )
    assert text_of(deltas) == full[:cut]
    assert deltas[-1].finish_reason == Finish.STOP
    assert stop not in text_of(deltas)


async def test_max_tokens_and_eos(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load(llama_dir)
    engine = await make_engine(llama_dir, model, tokenizer)
    ids = [9, 10, 11]
    free_run = tokens_of(
        await collect(engine.submit(EngineRequest("len", input_ids=ids, params=greedy(12, ignore_eos=True))))
    )
    assert len(free_run) == 12
    await engine.close()

    # Make the 5th greedy token the EOS token: the stream must end there, with it, as `eos`.
    model.generation_config.eos_token_id = free_run[4]
    engine = await make_engine(llama_dir, model, tokenizer)
    deltas = await collect(engine.submit(EngineRequest("eos", input_ids=ids, params=greedy(12))))
    assert tokens_of(deltas) == free_run[: free_run.index(free_run[4]) + 1]
    assert deltas[-1].finish_reason == Finish.EOS
    ignoring = await collect(engine.submit(EngineRequest("ignore", input_ids=ids, params=greedy(12, ignore_eos=True))))
    assert tokens_of(ignoring) == free_run and ignoring[-1].finish_reason == Finish.LENGTH


async def test_cancel_mid_stream_frees_kv(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    stream = engine.submit(EngineRequest("long", input_ids=[3, 4, 5], params=greedy(500, ignore_eos=True)))
    other = engine.submit(EngineRequest("other", input_ids=[6, 7], params=greedy(10, ignore_eos=True)))
    first = await anext(stream)
    await wait_until(lambda: engine.stats().kv_blocks_used > 0)
    assert engine.cancel("long")
    rest = await collect(stream)
    assert rest[-1].finish_reason == Finish.CANCELLED
    assert len(tokens_of([first, *rest])) < 500
    assert len(tokens_of(await collect(other))) == 10
    await wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.idle)
    assert engine.stats().kv_blocks_reserved == 0
    assert not engine.cancel("long")


async def kill_engine_thread_once(engine: Any, model: Any) -> None:
    """Makes the model's next forward raise (once): the request running then fails and the thread restarts."""
    original_forward = model.forward

    def broken_forward(*args: Any, **kwargs: Any) -> Any:
        model.forward = original_forward  # fail exactly once
        raise RuntimeError("simulated device fault")

    model.forward = broken_forward
    with pytest.raises(EngineFailed):
        await collect(engine.submit(EngineRequest("victim", input_ids=[3, 4], params=greedy(50))))
    await wait_until(lambda: engine.stats().restarts == 1 and engine.alive)


async def test_failed_engine_thread_restarts(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load(llama_dir)
    engine = await make_engine(llama_dir, model, tokenizer)
    expected = tokens_of(await collect(engine.submit(EngineRequest("before", input_ids=[3, 4], params=greedy(6)))))

    await kill_engine_thread_once(engine, model)
    after = await collect(engine.submit(EngineRequest("after", input_ids=[3, 4], params=greedy(6))))
    assert tokens_of(after) == expected


async def test_stats_count_what_was_served(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir, max_batch_tokens=64)
    before = engine.stats()
    assert before.kv_blocks_total == 4096 // 16 and before.running == before.waiting == 0
    prompts = [[3 + i] * (10 + i) for i in range(6)]
    streams = [
        engine.submit(EngineRequest(f"s{i}", input_ids=p, params=greedy(5, ignore_eos=True)))
        for i, p in enumerate(prompts)
    ]
    during = engine.stats()
    assert during.running + during.waiting == 6 and during.kv_blocks_reserved > 0
    await asyncio.gather(*(collect(s) for s in streams))
    after = engine.stats()
    assert after.prefill_tokens == sum(len(p) for p in prompts)
    # The first token comes out of the prefill step, the other four from decode steps.
    assert after.decode_tokens == 6 * 4
    assert after.steps > 0 and 0 < after.batch_fill_p50 <= after.batch_fill_p99 <= 1.0
    assert after.requests_finished == {"length": 6}
    assert after.running == after.waiting == after.kv_blocks_reserved == 0


async def test_model_is_usable_by_generate_after_close(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load(llama_dir)
    expected = reference_greedy(model, [3, 4, 5], 5)
    engine = await make_engine(llama_dir, model, tokenizer)
    assert (
        tokens_of(await collect(engine.submit(EngineRequest("x", input_ids=[3, 4, 5], params=greedy(5))))) == expected
    )
    await engine.close()
    assert reference_greedy(model, [3, 4, 5], 5) == expected


async def test_resume_continues_the_same_stream(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    ids = [3, 4, 5, 6]
    full = await collect(engine.submit(EngineRequest("full", input_ids=ids, params=greedy(20, ignore_eos=True))))
    tokens, text = tokens_of(full), text_of(full)
    delivered = tokens[:7]
    delivered_text = engine.tokenizer.decode(delivered)[:-2]  # as if two characters were still held back
    resumed = await collect(
        engine.submit(
            EngineRequest(
                "again", input_ids=ids, params=greedy(20, ignore_eos=True), resume=Resume(delivered, delivered_text)
            )
        )
    )
    assert delivered + tokens_of(resumed) == tokens
    assert delivered_text + text_of(resumed) == text
    assert resumed[-1].prompt_tokens == len(ids) and resumed[-1].finish_reason == Finish.LENGTH
    with pytest.raises(RequestRejected, match="nothing left"):
        engine.submit(EngineRequest("done", input_ids=ids, params=greedy(7), resume=Resume(delivered, delivered_text)))


async def test_same_id_resubmitted_right_after_cancel_gets_only_its_own_tokens(
    llama_dir: Path, make_engine: Any
) -> None:
    engine = await make_engine(llama_dir)
    ids = [3, 4, 5, 6]
    expected = tokens_of(
        await collect(engine.submit(EngineRequest("ref", input_ids=ids, params=greedy(60, ignore_eos=True))))
    )
    first = engine.submit(EngineRequest("same", input_ids=ids, params=greedy(60, ignore_eos=True)))
    delivered = tokens_of([await anext(first)])
    assert engine.cancel("same")  # the library drops the old run a step later; the new one must not see it
    again = engine.submit(
        EngineRequest("same", input_ids=ids, params=greedy(60, ignore_eos=True), resume=Resume(delivered, ""))
    )
    assert delivered + tokens_of(await collect(again)) == expected


async def test_requests_waiting_for_kv_survive_an_engine_restart(llama_dir: Path, make_engine: Any) -> None:
    """Two requests run and two wait for KV blocks when the thread dies: the running ones fail (retryable),
    the waiting ones go to the new engine and finish."""
    model, tokenizer = load(llama_dir)
    engine = await make_engine(llama_dir, model, tokenizer, kv_cache_tokens=128, page_size=16)
    params = greedy(50, ignore_eos=True)  # 10 + 50 tokens = 4 blocks of 16: two requests fill the 8 blocks
    streams = [engine.submit(EngineRequest(f"r{i}", input_ids=[3 + i] * 10, params=params)) for i in range(4)]
    assert engine.stats().running == 2 and engine.stats().waiting == 2
    original = model.forward

    def broken_forward(*args: Any, **kwargs: Any) -> Any:
        model.forward = original
        raise RuntimeError("simulated device fault")

    model.forward = broken_forward
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(collect(s) for s in streams), return_exceptions=True), timeout=30
    )
    failed = [o for o in outcomes if isinstance(o, EngineFailed)]
    finished = [o for o in outcomes if isinstance(o, list) and len(tokens_of(o)) == 50]
    assert len(failed) == 2 and len(finished) == 2
    assert engine.stats().restarts == 1 and engine.idle and engine.stats().kv_blocks_reserved == 0


async def test_outputs_of_ended_requests_do_not_pile_up(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    for i in range(5):
        stream = engine.submit(EngineRequest(f"c{i}", input_ids=[3, 4], params=greedy(200, ignore_eos=True)))
        await anext(stream)
        engine.cancel(f"c{i}")
    await asyncio.sleep(0.5)  # the library's last outputs for them arrive, and the watchdog clears them
    assert engine._manager.library.output_router.output_queue.qsize() == 0


async def test_suspects_run_one_at_a_time_beside_other_requests(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir, max_running=16)
    suspects = [
        engine.submit(EngineRequest(f"s{i}", input_ids=[3 + i, 4, 5], params=greedy(12, ignore_eos=True), suspect=True))
        for i in range(3)
    ]
    others = [
        engine.submit(EngineRequest(f"o{i}", input_ids=[6 + i, 4, 5], params=greedy(12, ignore_eos=True)))
        for i in range(3)
    ]
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (4, 2)  # one suspect and every other request
    assert engine.free_slots() == 16 - 6  # waiting suspects hold their slots: a worker does not hoard them
    outputs = await asyncio.gather(*(collect(s) for s in suspects + others))
    assert [len(tokens_of(o)) for o in outputs] == [12] * 6


async def test_closing_during_a_restart_leaves_no_engine_thread(llama_dir: Path) -> None:
    import threading
    import time

    from worker.engine.core import Engine, EngineConfig

    model, tokenizer = load(llama_dir)
    engine = await Engine(model, tokenizer, EngineConfig(kv_cache_tokens=1024, page_size=16)).start()
    start_manager = engine._start_manager
    starting, restarted = threading.Event(), threading.Event()

    def slow_start() -> None:
        starting.set()
        time.sleep(0.5)  # the restart is still building its manager when the engine closes
        try:
            start_manager()
        finally:
            restarted.set()

    engine._start_manager = slow_start  # type: ignore[method-assign]
    original_forward = model.forward

    def broken_forward(*args: Any, **kwargs: Any) -> Any:
        model.forward = original_forward
        raise RuntimeError("simulated device fault")

    model.forward = broken_forward
    with pytest.raises(EngineFailed):
        await collect(engine.submit(EngineRequest("victim", input_ids=[3, 4], params=greedy(5))))
    await wait_until(starting.is_set)
    await engine.close()

    def generation_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if "_run_generation_loop" in t.name and t.is_alive()]

    await wait_until(restarted.is_set)
    await wait_until(lambda: not generation_threads())
    assert engine._manager is None
