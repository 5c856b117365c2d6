"""The few-row products against oneDNN's, by row count: where the kernel stops paying on this CPU, and how a kernel
source compares with another.

    python -m bench.few_rows [--dtype bfloat16|float32] [--rows 1,2,4,6,8,12,16] [--rounds 7] [--quick]
                             [--kernel-source FILE]

For each row count: the products of one token through SmolLM2-135M's shapes (30 layers' q/k/v, o, gate/up and
down, and the output head; random weights, about 270 MB in bfloat16, so every pass reads them from memory) by the
few-row kernel and by the product that runs above its limit (bfloat16: torch's linear, oneDNN; float32: oneDNN on
the packed weights), rounds alternated; the median ms and the GB/s of weights it reads. `--kernel-source FILE` also
times the kernel built from FILE (`git show REV:worker/engine/kernels/few_rows.c > /tmp/old.c`) and checks that its
outputs equal the shipped kernel's bit for bit. `--quick`: tiny shapes (the tests run it). The last line is one JSON
object: per row count, `few_rows_ms`, `onednn_ms` and their ratio, and `other_ms` with `--kernel-source`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.workload import print_json
from worker.engine import prepack
from worker.engine.kernels import cpu_kernels

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shapes:
    """A decoder's product shapes: `(in_features, out_features)` of each product a layer runs, and its head's."""

    layers: int
    products: tuple[tuple[int, int], ...]
    head: tuple[int, int]


SMOLLM2_135M = Shapes(30, ((576, 960), (576, 576), (576, 3072), (1536, 576)), (576, 49152))  # q/k/v, o, gate/up, down
TINY = Shapes(2, ((64, 128), (64, 64), (64, 256), (128, 64)), (64, 512))


def weights_of(shapes: Shapes, dtype: torch.dtype) -> list[torch.Tensor]:
    """Random weights of every product of a token, layer by layer, then the head's: the same ones in every run."""
    generator = torch.Generator().manual_seed(0)
    sizes = [*(shape for _ in range(shapes.layers) for shape in shapes.products), shapes.head]
    return [torch.randn(out, width, generator=generator).to(dtype) for width, out in sizes]


def onednn(weights: list[torch.Tensor]) -> tuple[Product, list[torch.Tensor]]:
    """What runs above the few-row limit (`prepack.onednn_product`): oneDNN on packed float32 weights, torch's
    linear (oneDNN too) on the dense bfloat16 ones."""
    return lambda x, packed: prepack.onednn_product(x, packed, None), [prepack.pack(w) for w in weights]


def kernel_from(source: Path, dtype: torch.dtype) -> cpu_kernels.FewRows:
    """The few-row kernel built from `source`, copied beside the shipped kernels' headers (it includes them); the
    build lands in the kernel cache, so the copy can go once it is loaded."""
    shipped = cpu_kernels.FEW_ROWS_SOURCE if dtype == torch.bfloat16 else cpu_kernels.FEW_ROWS_FLOAT32_SOURCE
    with tempfile.TemporaryDirectory(prefix="llmq-few-rows-") as folder:
        for header in shipped.parent.glob("*.h"):
            shutil.copy(header, folder)
        copy = Path(folder) / shipped.name
        shutil.copy(source, copy)
        built = cpu_kernels.few_rows(dtype, copy)
    if built is None:
        raise SystemExit(f"{source} did not build (the warning above says why)")
    return built


def pass_ms(product: Product, inputs: dict[int, torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Ms for one product of every weight, each by the rows of its input width."""
    start = time.perf_counter()
    for weight in weights:
        product(inputs[weight.shape[1]], weight)
    return (time.perf_counter() - start) * 1000


def measure(
    ways: dict[str, tuple[Product, list[torch.Tensor]]], rows: int, dtype: torch.dtype, rounds: int
) -> dict[str, float]:
    """The median ms of a pass through every weight, each way, the order of the ways reversed every other round."""
    widths = {weight.shape[1] for weight in next(iter(ways.values()))[1]}
    inputs = {width: torch.randn(rows, width).to(dtype) for width in widths}
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for name in names:  # a first pass each: builds, first-touch and oneDNN's primitive caches out of the figures
        pass_ms(ways[name][0], inputs, ways[name][1])
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            times[name].append(pass_ms(ways[name][0], inputs, ways[name][1]))
    return {name: statistics.median(values) for name, values in times.items()}


ODD_SHAPES = ((33, 7), (7, 3), (100, 65))  # (in, out): a last narrower column block, inputs off the vector width


def equal_bits(first: cpu_kernels.FewRows, second: cpu_kernels.FewRows, weights: list[torch.Tensor]) -> bool:
    """Whether both kernels give the same bits: on `weights`, and on odd shapes with a bias, at 1 to `few_rows_limit`
    rows (full passes of rows and shorter last ones)."""
    generator = torch.Generator().manual_seed(1)
    odd = [torch.randn(out, width, generator=generator).to(first.dtype) for width, out in ODD_SHAPES]
    biases = {id(weight): torch.randn(weight.shape[0], generator=generator).to(first.dtype) for weight in odd}
    for rows in range(1, prepack.few_rows_limit(first.dtype) + 1):
        for weight in [*weights, *odd]:
            x = torch.randn(rows, weight.shape[1], generator=generator).to(first.dtype)
            bias = biases.get(id(weight))
            if not torch.equal(first(x, weight, bias), second(x, weight, bias)):
                return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,6,8,12,16", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--kernel-source", type=Path, help="also the kernel built from this source, compared")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    kernel = cpu_kernels.few_rows(dtype)
    if kernel is None:
        raise SystemExit(f"no {args.dtype} few-row kernel on this machine (the warning above says why)")
    weights = weights_of(TINY if args.quick else SMOLLM2_135M, dtype)
    read_gb = sum(weight.numel() * weight.element_size() for weight in weights) / 1e9
    ways: dict[str, tuple[Product, list[torch.Tensor]]] = {
        "few_rows": (lambda x, w: kernel(x, w, None), weights),
        "onednn": onednn(weights),
    }
    other_equal = None
    if args.kernel_source is not None:
        other = kernel_from(args.kernel_source.resolve(strict=True), dtype)
        ways["other"] = (lambda x, w: other(x, w, None), weights)
        other_equal = equal_bits(kernel, other, weights)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {read_gb * 1000:.0f} MB of weights a pass")
    by_rows = {}
    for rows in (int(count) for count in args.rows.split(",")):
        ms = measure(ways, rows, dtype, args.rounds)
        figures = {f"{name}_ms": round(value, 4) for name, value in ms.items()}
        figures["few_rows_over_onednn"] = round(ms["few_rows"] / ms["onednn"], 3)
        line = "  ".join(f"{name} {value:7.2f} ms ({read_gb / value * 1000:5.1f} GB/s)" for name, value in ms.items())
        print(f"rows {rows:3d}: {line}  few_rows/onednn {figures['few_rows_over_onednn']:.3f}", flush=True)
        by_rows[str(rows)] = figures
    if other_equal is not None:
        print(f"{args.kernel_source} gives the shipped kernel's bits: {other_equal}")
    print_json(
        {"dtype": args.dtype, "threads": torch.get_num_threads(), "read_mb": round(read_gb * 1000), "rows": by_rows}
        | ({} if other_equal is None else {"other_equal_bits": other_equal})
    )


if __name__ == "__main__":
    main()
