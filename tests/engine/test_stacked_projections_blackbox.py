"""Black-box tests of the lean layers' stacked q/k/v and gate/up products (`StackedLinears`) through the engine.

The claim under test: on CPU float32 the engine's lean Llama-family layers run q/k/v as one product and gate/up as
another over stacked, pre-packed weights, rotate q and k together, and give the library layers' bits: greedy tokens
and logprobs equal those of the same engine with lean layers off, and greedy tokens equal `model.generate`. int8
models keep their own products. The stacked copy is packed again when a weight or bias changes in place or is
swapped, so a model changed between requests serves its new weights.

References are separately loaded models; where weights change they are loaded without pre-packing (plain
`nn.Linear`, the library's own product), so no packed copy of ours stands on both sides of a comparison.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from testing.tiny_models import build_tokenizer, save_tiny_model
from tests.engine.conftest import reference_greedy
from tests.engine.cpu_engine_support import collect, load, running_engine, tokens_of
from tests.engine.test_cpu_engine_blackbox import one_thread  # noqa: F401  (fixture: torch on one thread)
from tests.polling import wait_until
from worker.engine import lean_layers
from worker.engine.loader import LoadOptions, load_model
from worker.engine.types import EngineRequest, Finish, GenerationParams, OutputDelta

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_POSITIONS = 160  # small, so prompts at the context limit stay cheap
BUDGET = 24  # max_batch_tokens: long prompts are prefilled in several chunks


def save_biased_llama(folder: Path) -> Path:
    """A llama whose every projection has a (random, non-zero) bias, one KV head for four query heads, and a
    head_dim (24) that is not hidden_size / heads (16): q, k and v are all of different widths in the stack."""
    torch.manual_seed(5)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=MAX_POSITIONS,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.3,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.3)  # the library starts biases at zero: a misplaced one would not show
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_model(folder: Path, variant: str) -> Path:
    if variant == "biased-llama":
        return save_biased_llama(folder)
    return save_tiny_model(folder, variant, max_positions=MAX_POSITIONS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Model folders by variant (`llama`, `qwen2`, `biased-llama`), each saved once for the module."""
    saved: dict[str, Path] = {}

    def folder(variant: str) -> Path:
        if variant not in saved:
            saved[variant] = save_model(tmp_path_factory.mktemp(f"stacked-{variant}"), variant)
        return saved[variant]

    return folder


def load_unpacked(folder: Path) -> Any:
    """The library's own layers and products: no pre-packed copy of any weight."""
    model, _ = load_model(str(folder), LoadOptions(cache_dir=folder / "cache", prepack=False))
    return model


def greedy(max_new_tokens: int, **kwargs: Any) -> GenerationParams:
    return GenerationParams(max_new_tokens=max_new_tokens, temperature=0, **kwargs)


def vocab_of(model: Any) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def ragged_workload(vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens): one-token prompts, prompts several budgets long (chunked prefill), and prompts
    that with their new tokens fill the model's context exactly or all but one position. Ids avoid the specials."""
    rng = random.Random(seed)
    shapes = [
        (1, 1), (1, 12), (2, 7), (BUDGET - 1, 3), (BUDGET, 1), (BUDGET + 1, 9), (3 * BUDGET + 5, 6),
        (MAX_POSITIONS - 6, 6), (MAX_POSITIONS - 2, 1), (MAX_POSITIONS - 20, 19), (9, 25),
    ]  # fmt: skip
    return [([rng.randrange(3, vocab) for _ in range(length)], n) for length, n in shapes]


Outcome = tuple[list[int], list[tuple[float, list[tuple[int, float]]]], Finish | None]


def outcome(deltas: list[OutputDelta]) -> Outcome:
    """Tokens, each token's (logprob, top alternatives) exactly as reported, and the finish reason."""
    entries = [(entry.logprob, list(entry.top)) for delta in deltas for entry in delta.logprobs or []]
    return tokens_of(deltas), entries, deltas[-1].finish_reason


async def run_each_alone(engine: Any, workload: list[tuple[list[int], int]], tag: str) -> list[Outcome]:
    """Each request alone, with its top-4 logprobs: every run batches the same way, so bits are comparable."""
    results = []
    for index, (ids, n) in enumerate(workload):
        request = EngineRequest(f"{tag}{index}", input_ids=ids, params=greedy(n, logprobs=4))
        results.append(outcome(await collect(engine.submit(request))))
    return results


async def run_together(engine: Any, workload: list[tuple[list[int], int]], tag: str) -> list[list[int]]:
    streams = [
        engine.submit(EngineRequest(f"{tag}{index}", input_ids=ids, params=greedy(n)))
        for index, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    return [tokens_of(deltas) for deltas in results]


def lean_installed(model: Any) -> bool:
    return all("forward" in vars(layer) for layer in model.model.layers)


# ================================================================================================ exact bits


@pytest.mark.parametrize("variant", ["qwen2", "biased-llama"])
async def test_lean_stacked_layers_give_the_library_layers_bits(
    variant: str, folders: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-token prompts, chunked prefills and prompts at the context limit, each alone: tokens, logprobs and top-4
    alternatives of the lean (stacked) layers are bitwise those of the same engine with lean layers off, and the
    tokens are `generate`'s on an unpacked copy of the model."""
    folder = folders(variant)
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=21)
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        assert lean_installed(model), "the lean layers serve this model"
        lean = await run_each_alone(engine, workload, "lean")
    monkeypatch.setattr(lean_layers, "install", lambda model: False)
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        assert not any("forward" in vars(layer) for layer in model.model.layers)
        library = await run_each_alone(engine, workload, "library")
    reference = load_unpacked(folder)
    for index, ((ids, n), got, want) in enumerate(zip(workload, lean, library, strict=True)):
        assert got == want, f"request {index} ({len(ids)} prompt tokens): lean bits differ from the library layers'"
        tokens, entries, finish = got
        assert len(entries) == len(tokens) > 0
        assert all(len(top) == 4 and top[0][0] == token for token, (_, top) in zip(tokens, entries, strict=True))
        assert tokens == reference_greedy(reference, ids, n), f"request {index} ({len(ids)} prompt tokens)"
        assert finish == (Finish.LENGTH if len(tokens) == n else Finish.EOS)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "biased-llama"])
async def test_a_ragged_crowd_at_the_context_limit_matches_generate(
    variant: str, folders: Callable[[str], Path]
) -> None:
    """All at once, twice over (22 requests, more than fit one 24-token step): every greedy output equals
    `generate` one prompt at a time on a separately loaded model."""
    folder = folders(variant)
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=4) + ragged_workload(vocab_of(model), seed=5)
    reference, _ = load(folder)
    expected = [reference_greedy(reference, ids, n) for ids, n in workload]
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        assert lean_installed(model)
        got = await run_together(engine, workload, "crowd")
        await wait_until(lambda: engine.idle and engine.stats().kv_blocks_used == 0)
        assert engine.stats().restarts == 0
    for index, ((ids, n), tokens) in enumerate(zip(workload, got, strict=True)):
        assert tokens == expected[index], f"request {index} ({len(ids)} prompt tokens, {n} new)"


async def test_sampled_neighbours_do_not_disturb_greedy_rows(folders: Callable[[str], Path]) -> None:
    """Greedy requests share steps with hot, seeded, penalised samplers asking for logprobs; the greedy ones are
    still `generate`'s, and every sampled token is a real vocabulary id."""
    folder = folders("biased-llama")
    model, tokenizer = load(folder)
    vocab = vocab_of(model)
    workload = ragged_workload(vocab, seed=12)
    reference, _ = load(folder)
    expected = [reference_greedy(reference, ids, n) for ids, n in workload]
    hot = GenerationParams(
        max_new_tokens=15, temperature=1.8, top_p=0.95, top_k=50, seed=3, logprobs=2, repetition_penalty=1.3
    )
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        sampled = [
            engine.submit(EngineRequest(f"hot{index}", input_ids=ids[:40], params=hot))
            for index, (ids, _) in enumerate(workload)
        ]
        greedy_streams = [
            engine.submit(EngineRequest(f"cold{index}", input_ids=ids, params=greedy(n)))
            for index, (ids, n) in enumerate(workload)
        ]
        cold = await asyncio.gather(*(collect(stream) for stream in greedy_streams))
        warm = await asyncio.gather(*(collect(stream) for stream in sampled))
    for index, deltas in enumerate(cold):
        assert tokens_of(deltas) == expected[index], f"greedy request {index}"
    for deltas in warm:
        tokens = tokens_of(deltas)
        assert deltas[-1].finished and 0 < len(tokens) <= 15
        assert all(0 <= token < vocab for token in tokens)
        assert len([entry for delta in deltas for entry in delta.logprobs or []]) == len(tokens)


# ================================================================================================ changed weights


def scale_k_weight(model: Any) -> None:
    model.model.layers[1].self_attn.k_proj.weight.mul_(1.7)


def shift_v_bias(model: Any) -> None:
    bias = model.model.layers[0].self_attn.v_proj.bias
    bias.add_(torch.linspace(-2.0, 2.0, bias.numel()))


def reload_up_weight(model: Any) -> None:
    """Through `load_state_dict` (an in-place copy, as a hot reload does), only `up_proj` of layer 0 differs."""
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weight = state["model.layers.0.mlp.up_proj.weight"]
    state["model.layers.0.mlp.up_proj.weight"] = weight.flip(0) * 1.5
    model.load_state_dict(state)


def reset_q_weight(model: Any) -> None:
    """q of layer 0 replaced by a fixed random matrix of the same shape, copied in place."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)))


CHANGES = {
    "llama-k-weight": ("llama", scale_k_weight),
    "qwen2-v-bias": ("qwen2", shift_v_bias),
    "llama-up-weight-by-load_state_dict": ("llama", reload_up_weight),
    "biased-llama-q-weight": ("biased-llama", reset_q_weight),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
async def test_weights_changed_in_place_between_requests_are_served(
    change: str, folders: Callable[[str], Path]
) -> None:
    """The engine serves, a weight or bias of its model changes in place, the engine serves again: the new outputs
    are those of a fresh (unpacked) model with the same change, and not the old ones (no stale stacked copy)."""
    variant, apply = CHANGES[change]
    folder = folders(variant)
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=31)[:8]
    before_reference, after_reference = load_unpacked(folder), load_unpacked(folder)
    with torch.no_grad():
        apply(after_reference)
    expected_before = [reference_greedy(before_reference, ids, n) for ids, n in workload]
    expected_after = [reference_greedy(after_reference, ids, n) for ids, n in workload]
    assert expected_after != expected_before, "the change must matter, or this test proves nothing"
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        assert await run_together(engine, workload, "before") == expected_before
        await wait_until(lambda: engine.idle)
        with torch.no_grad():
            apply(model)
        after = await run_together(engine, workload, "after")
        assert lean_installed(model)
    for index, tokens in enumerate(after):
        assert tokens == expected_after[index], f"request {index}: served with the weights from before the change"


async def test_a_parameter_swapped_between_requests_is_served(folders: Callable[[str], Path]) -> None:
    """`k_proj.weight` and `k_proj.bias` of qwen2 replaced by new `nn.Parameter`s (new tensors, nothing changed in
    place) after the engine has served: the next outputs use them."""
    folder = folders("qwen2")
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=41)[:8]
    generator = torch.Generator().manual_seed(11)
    attention = model.model.layers[0].self_attn
    new_weight = attention.k_proj.weight.detach() * -1.3
    new_bias = torch.randn(attention.k_proj.bias.shape, generator=generator)
    before_reference, after_reference = load_unpacked(folder), load_unpacked(folder)
    with torch.no_grad():
        after_reference.model.layers[0].self_attn.k_proj.weight.copy_(new_weight)
        after_reference.model.layers[0].self_attn.k_proj.bias.copy_(new_bias)
    expected_before = [reference_greedy(before_reference, ids, n) for ids, n in workload]
    expected_after = [reference_greedy(after_reference, ids, n) for ids, n in workload]
    assert expected_after != expected_before
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        assert await run_together(engine, workload, "before") == expected_before
        await wait_until(lambda: engine.idle)
        attention.k_proj.weight = nn.Parameter(new_weight)
        attention.k_proj.bias = nn.Parameter(new_bias)
        after = await run_together(engine, workload, "after")
    assert after == expected_after


async def test_two_swaps_between_requests_serve_the_last_parameter(folders: Callable[[str], Path]) -> None:
    """Rounds of: serve, then replace `k_proj.weight` twice (a first try, then the one meant) before the next
    request. Each round's outputs must come from the last parameter set."""
    folder = folders("llama")
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=51)[:6]
    attention = model.model.layers[0].self_attn
    reference = load_unpacked(folder)
    base = attention.k_proj.weight.detach().clone()
    stale_rounds = []
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        await run_together(engine, workload, "warm")
        for round_ in range(20):
            first_try, meant = base * (0.5 + round_), base * -(1.0 + round_)
            with torch.no_grad():
                reference.model.layers[0].self_attn.k_proj.weight.copy_(meant)
            expected = [reference_greedy(reference, ids, n) for ids, n in workload]
            await wait_until(lambda: engine.idle)
            attention.k_proj.weight = nn.Parameter(first_try)
            attention.k_proj.weight = nn.Parameter(meant)
            if await run_together(engine, workload, f"round{round_}-") != expected:
                stale_rounds.append(round_)
    assert stale_rounds == [], f"rounds served with a stale k_proj weight: {stale_rounds}"


async def test_a_bias_changed_through_data_is_served_like_the_library_layers(
    folders: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`v_proj.bias.data` shifted in place after the engine has served (as older code and many utilities do):
    the lean engine's next outputs must equal those of the library layers on the same changed model."""
    folder = folders("biased-llama")
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=61)[:6]
    bias = model.model.layers[0].self_attn.v_proj.bias
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        before = await run_each_alone(engine, workload, "before")
        await wait_until(lambda: engine.idle)
        bias.data.add_(torch.linspace(-3.0, 3.0, bias.numel()))
        engine.reset_prefix_cache()  # a change through `.data` is invisible to the engine (and to autograd)
        lean_after = await run_each_alone(engine, workload, "after")
    monkeypatch.setattr(lean_layers, "install", lambda model: False)
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        library_after = await run_each_alone(engine, workload, "library")
    assert library_after != before, "the change matters to the library layers"
    assert lean_after == library_after


async def test_a_swapped_output_projection_is_served(folders: Callable[[str], Path]) -> None:
    """`o_proj.weight` and `down_proj.weight` (the unstacked products of the lean layer) replaced by new
    parameters after the engine has served: the next outputs must use them."""
    folder = folders("llama")
    model, tokenizer = load(folder)
    workload = ragged_workload(vocab_of(model), seed=71)[:6]
    layer = model.model.layers[1]
    new_o = layer.self_attn.o_proj.weight.detach() * -2.0
    new_down = layer.mlp.down_proj.weight.detach().flip(0)
    after_reference = load_unpacked(folder)
    with torch.no_grad():
        after_reference.model.layers[1].self_attn.o_proj.weight.copy_(new_o)
        after_reference.model.layers[1].mlp.down_proj.weight.copy_(new_down)
    expected_after = [reference_greedy(after_reference, ids, n) for ids, n in workload]
    async with running_engine(model, tokenizer, max_batch_tokens=BUDGET) as engine:
        before = await run_together(engine, workload, "before")
        assert before != expected_after, "the change must matter"
        await wait_until(lambda: engine.idle)
        layer.self_attn.o_proj.weight = nn.Parameter(new_o)
        layer.mlp.down_proj.weight = nn.Parameter(new_down)
        after = await run_together(engine, workload, "after")
    assert after == expected_after


# ================================================================================================ int8


async def test_int8_model_keeps_its_own_products_and_stays_healthy(
    folders: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 (with q/k/v and MLP biases): alone, the lean layers give the library layers' bits, on steps of up to 32
    rows (int8 products) and larger chunked prefills; outputs differ from float32's somewhere (the int8 weights
    were used, not a stacked float32 copy); a crowd afterwards finishes without a restart and its outputs repeat
    serving the lone runs' bits again."""
    folder = folders("biased-llama")
    model, tokenizer = load_model(str(folder), LoadOptions(cache_dir=folder / "cache", quantize="int8"))
    workload = ragged_workload(vocab_of(model), seed=81)
    async with running_engine(model, tokenizer, max_batch_tokens=48) as engine:
        assert lean_installed(model)
        lean = await run_each_alone(engine, workload, "lean")
        crowd = await run_together(engine, workload, "crowd")
        await wait_until(lambda: engine.idle and engine.stats().kv_blocks_used == 0)
        assert engine.stats().restarts == 0 and engine.alive
        again = await run_each_alone(engine, workload[:3], "again")
    monkeypatch.setattr(lean_layers, "install", lambda model: False)
    async with running_engine(model, tokenizer, max_batch_tokens=48) as engine:
        library = await run_each_alone(engine, workload, "library")
    float_model, float_tokenizer = load(folder)
    async with running_engine(float_model, float_tokenizer, max_batch_tokens=48) as engine:
        float32 = await run_each_alone(engine, workload, "float")
    assert lean == library
    assert again == lean[:3], "the engine serves the same bits after a crowd"
    assert [tokens for tokens, _, _ in lean] != [tokens for tokens, _, _ in float32] or [
        entries for _, entries, _ in lean
    ] != [entries for _, entries, _ in float32], "int8 outputs equal float32's: the int8 products were not used"
    assert all(0 < len(tokens) <= n for tokens, (_, n) in zip(crowd, workload, strict=True))
