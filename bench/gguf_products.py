"""The GGUF types kept as the file holds them, measured (docs/decisions/067-gguf-types-kept.md).

Without --requantize: for each type engine/runner/gguf_grids.py keeps, a --rows x --cols weight
of random blocks (random codes, realistic scales) is kept as the engine keeps it
(engine/runner/gguf_linears.py's kept_linear). One JSON line per type: the layer, the relative
error of its decode product (one row, the C++ kernels' int16 activations) and of its prefill
product (--prefill-rows rows, the dense copy in gemm_dtype()) against the fp32 product with
gguf-py's dequantized weights (what transformers loads), the microseconds of one decode product
and of the fp32 product with the dequantized weights (the fastest of 5 batches), and the bits
per weight the product reads against the file's.

--requantize TYPE OUT: the embedded model with its decoder linears re-quantized by gguf-py to
TYPE (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0; gguf-py has no K-quant quantizer), every other tensor and
all metadata as the embedded file holds them: a real model in that type, for --check,
decode_floor (--dtypes float32+auto-linears) and decode_agreement (--linear-dtypes auto).

--check FILE...: each GGUF loaded as the engine keeps it and as the fp32 reference
(--linear-dtype float32): its layers by kind, the largest decode product error per kind (one
random row per layer) and the last token's logits after a 9-token prefill, against the
reference.

    longserve bench gguf_products
    longserve bench gguf_products --requantize Q8_0 /tmp/smollm2-q8_0.gguf
    longserve bench gguf_products --check /tmp/smollm2-q8_0.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.runner.gguf_grids import KEPT_TYPES, decode
from engine.runner.gguf_linears import kept_linear
from engine.runner.quant_linears import Int4Linear, small_matmul

# each type's fp16 fields (byte offset, size) in a block: d, then m or dmin where it has one
FP16_FIELDS = {
    "Q4_0": ((0, 6e-3),),
    "Q4_1": ((0, 6e-3), (2, -0.05)),
    "Q5_0": ((0, 3e-3),),
    "Q5_1": ((0, 3e-3), (2, -0.05)),
    "Q8_0": ((0, 4e-4),),
    "Q4_K": ((0, 1e-4), (2, 8e-4)),
    "Q5_K": ((0, 5e-5), (2, 8e-4)),
    "Q6_K": ((208, 1e-4),),
    "Q3_K": ((108, 4e-4),),  # not kept: for tests of what stays as transformers loads it
}
_REQUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) of random blocks of `kind`, its fp16 fields set to sane sizes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at, scale in FP16_FIELDS[kind]:
        values = (rng.uniform(0.5, 1.0, (len(blocks), 1)) * scale).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8)
    return blocks.reshape(rows, -1)


def bits_per_weight(layer: torch.nn.Module) -> float:
    """Bits per weight that the decode product reads: codes, scales and minimums."""
    if isinstance(layer, Int4Linear):
        tensors = [layer.codes, layer.block_scales, layer.block_mins]
    else:
        tensors = [t for t in (layer.codes, layer.block_scales, layer.block_mins) if t is not None]
    n, k = layer.out_features, layer.in_features
    return sum(t.numel() * t.element_size() for t in tensors) * 8 / (n * k)


def fastest_us(call: Callable[[], object], repeats: int) -> float:
    """Microseconds per call: the fastest of 5 batches of `repeats` calls (the machine may be
    shared: the fastest batch is the one least disturbed)."""
    for _ in range(5):
        call()
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        batches.append((time.perf_counter() - started) / repeats * 1e6)
    return min(batches)


def measure(kind: str, args: argparse.Namespace) -> dict:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(kind, args.rows, args.cols)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    layer = kept_linear(decode(raw, kind), None)
    product = small_matmul(layer)
    x = torch.randn(1, args.cols)
    decode_error = float((product(x) - x @ weight.t()).norm() / (x @ weight.t()).norm())
    xs = torch.randn(args.prefill_rows, args.cols)
    prefill_error = float((layer(xs) - xs @ weight.t()).norm() / (xs @ weight.t()).norm())
    us = fastest_us(lambda: product(x), args.repeats)
    fp32_us = fastest_us(lambda: torch.nn.functional.linear(x, weight), args.repeats)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return {
        "bench": "gguf_products",
        "type": kind,
        "layer": type(layer).__name__,
        "shape": [args.rows, args.cols],
        "decode_rel_error": float(f"{decode_error:.2e}"),
        "prefill_rel_error": float(f"{prefill_error:.2e}"),
        "decode_product_us": round(us, 1),
        "fp32_product_us": round(fp32_us, 1),
        "bits_per_weight_read": round(bits_per_weight(layer), 2),
        "bits_per_weight_file": round(size * 8 / block, 2),
    }


def requantize(kind: str, out: Path) -> None:
    """The embedded model with its decoder linears in `kind` (see the module's docstring)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from engine.runner.gguf_grids import DECODER_LINEARS
    from engine.runner.loader import embedded_model_path

    reader = gguf.GGUFReader(embedded_model_path())
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    target = gguf.GGMLQuantizationType[kind]
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[2] in DECODER_LINEARS:
            weights = dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, quantize(weights, target), raw_dtype=target)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_file(path: str) -> dict:
    """The GGUF at `path` loaded as the engine keeps it and as the fp32 reference: the layers
    kept, by kind, the largest decode product error per kind (one random row per layer) and
    the last token's logits after a 9-token prefill (the dense copies), against the reference."""
    from engine.config import EngineConfig
    from engine.runner.loader import load_model
    from engine.runner.quant_linears import Int8Linear

    config = EngineConfig(model=path, device="cpu", lean_decode=False)
    reference = load_model(dataclasses.replace(config, linear_dtype="float32")).model
    kept = load_model(config)
    weights = dict(reference.named_modules())
    kinds: dict[str, int] = {}
    errors: dict[str, float] = {}
    for name, m in kept.model.named_modules():
        if isinstance(m, Int4Linear | Int8Linear):
            mins = (
                " with minimums" if isinstance(m, Int8Linear) and m.block_mins is not None else ""
            )
            kind = f"{type(m).__name__} per {m.group}{mins}"
            x = torch.randn(1, m.in_features)
            want = x @ weights[name].weight.detach().t()
            error = float((small_matmul(m)(x) - want).norm() / want.norm())
            errors[kind] = max(errors.get(kind, 0.0), error)
        elif isinstance(m, torch.nn.Linear):
            kind = "float"
        else:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    ids = torch.arange(9)[None] * 97 + 100
    with torch.inference_mode():
        a, b = reference(input_ids=ids).logits[0, -1], kept.model(input_ids=ids).logits[0, -1]
    return {
        "bench": "gguf_products",
        "file": path,
        "linear_dtype": kept.linear_dtype,
        "layers": kinds,
        "largest_decode_rel_error": {k: float(f"{v:.2e}") for k, v in errors.items()},
        "prefill_logits_rel_error": float(f"{float((a - b).norm() / a.norm()):.2e}"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(KEPT_TYPES))
    parser.add_argument("--rows", type=int, default=1536, help="outputs (SmolLM2's gate/up)")
    parser.add_argument("--cols", type=int, default=768, help="inputs, a multiple of 256")
    parser.add_argument("--prefill-rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--requantize", nargs=2, metavar=("TYPE", "OUT"))
    parser.add_argument("--check", nargs="+", metavar="FILE", help="GGUF files to check")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch's threads (0: its default; 1 is steadier "
        "on a shared machine, where a product's threads wait for each other's time slices)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.requantize:
        kind, out = args.requantize
        if kind not in _REQUANTIZABLE:
            parser.error(f"--requantize takes one of {_REQUANTIZABLE}")
        requantize(kind, Path(out))
        print(json.dumps({"bench": "gguf_products", "requantized": kind, "out": out}))
        return
    torch.manual_seed(0)
    for path in args.check or []:
        print(json.dumps(check_file(path)), flush=True)
    if args.check:
        return
    for kind in args.types:
        print(json.dumps(measure(kind, args)), flush=True)


if __name__ == "__main__":
    main()
