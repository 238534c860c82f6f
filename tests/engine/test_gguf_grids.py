"""GGUF linears kept as the file holds them, type by type (engine/runner/gguf_grids.py,
engine/runner/gguf_linears.py): each type's blocks decode to the weights gguf-py dequantizes,
the kept layers multiply those weights, and a tiny Llama GGUF mixing every type (written here,
blocks of random bytes) loads with each linear on its own grid and generates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gguf_products import random_blocks
from engine.config import EngineConfig
from engine.protocol import SamplingParams
from engine.runner.gguf_grids import KEPT_TYPES, decode, rope_rows
from engine.runner.gguf_linears import kept_linear
from engine.runner.loader import embedded_model_path, gguf_kept_types, load_model, resolve_precision
from engine.runner.quant_linears import SMALL_M, Int4Linear, Int8Linear, quant_kernels, small_matmul
from engine.runner.weights import fuse_linears

CODES = {  # the codes each type holds
    "Q4_0": (0, 15),
    "Q4_1": (0, 15),
    "Q4_K": (0, 15),
    "Q5_0": (-16, 15),
    "Q5_1": (0, 31),
    "Q5_K": (0, 31),
    "Q6_K": (-32, 31),
    "Q8_0": (-128, 127),
}
kernels_built = pytest.mark.skipif(quant_kernels() is None, reason="no C++ compiler or ninja")


def dequantized(raw: np.ndarray, kind: str) -> torch.Tensor:
    """gguf-py's own dequantization, as transformers' GGUF loader calls it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_each_type_decodes_to_the_weights_gguf_py_dequantizes(kind):
    raw = random_blocks(kind, 48, 512, seed=1)
    grid = decode(raw, kind)
    assert grid.codes.shape == (48, 512) and grid.codes.dtype == torch.int8
    low, high = CODES[kind]
    assert (int(grid.codes.min()), int(grid.codes.max())) == (low, high)
    assert grid.scales.shape == (48, 512 // (16 if kind == "Q6_K" else 32))
    assert torch.equal(grid.dequantized(), dequantized(raw, kind))  # bit for bit


@kernels_built
@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_kept_layers_multiply_the_weights_the_file_holds(kind):
    """The kernels' products are within their int16 activations' rounding (~5e-5) of the
    product with the file's weights; the kind of layer follows the type."""
    raw = random_blocks(kind, 96, 512, seed=2)
    weight = dequantized(raw, kind)
    bias = torch.randn(96) * 0.01
    layer = kept_linear(decode(raw, kind), bias)
    assert isinstance(layer, Int4Linear if kind in ("Q4_0", "Q4_1", "Q4_K") else Int8Linear)
    if isinstance(layer, Int8Linear):
        assert layer.group == (16 if kind == "Q6_K" else 32)
        assert (layer.block_mins is not None) == (kind in ("Q5_1", "Q5_K"))
    for rows in (1, 3, SMALL_M):
        x = torch.randn(rows, 512)
        assert relative_error(layer(x), x @ weight.t() + bias) < 2e-4, rows
        bare = small_matmul(kept_linear(decode(raw, kind), None))(x)
        assert relative_error(bare, x @ weight.t()) < 2e-4, rows
    x = torch.randn(SMALL_M + 4, 512)  # prefill: the dense copy, in bf16 where native
    assert relative_error(layer(x), x @ weight.t() + bias) < 1e-2


@kernels_built
@pytest.mark.parametrize("inputs", [512, 544])  # 544: an odd number of blocks (17)
def test_q4_0_layers_read_no_minimums(inputs):
    """Q4_0's grid (w = (q - 8) d) keeps no minimums: the kernel takes -8 d for them, with
    the blocks taken two at a time and an odd one alone; Q4_1's keeps its own. Parts of the
    two kinds do not fuse."""
    layers = {}
    for kind in ("Q4_0", "Q4_1"):
        raw = random_blocks(kind, 64, inputs, seed=5)
        layers[kind] = kept_linear(decode(raw, kind), None)
        assert (layers[kind].block_mins.numel() == 0) == (kind == "Q4_0")
        weight = dequantized(raw, kind)
        for rows in (1, 2, SMALL_M):
            x = torch.randn(rows, inputs)
            assert relative_error(layers[kind](x), x @ weight.t()) < 2e-4, (kind, rows)
    assert not isinstance(fuse_linears([layers["Q4_0"], layers["Q4_1"]]), Int4Linear)
    again = kept_linear(decode(random_blocks("Q4_0", 64, inputs, seed=6), "Q4_0"), None)
    x = torch.randn(2, inputs)
    want = torch.cat([layers["Q4_0"](x), again(x)], -1)
    fused = fuse_linears([layers["Q4_0"], again])
    if fused is not None:  # where torch's packed layout lets the rows concatenate
        assert isinstance(fused, Int4Linear) and fused.block_mins.numel() == 0
        torch.testing.assert_close(fused(x), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@kernels_built
def test_int8_parts_fuse_into_one_and_become_views():
    parts = [
        kept_linear(decode(random_blocks("Q6_K", 64, 256, seed), "Q6_K"), None) for seed in (3, 4)
    ]
    x = torch.randn(2, 256)
    want = torch.cat([p(x) for p in parts], -1)
    fused = fuse_linears(parts)
    assert isinstance(fused, Int8Linear) and fused.out_features == 128
    torch.testing.assert_close(fused(x), want, rtol=0, atol=0)
    assert parts[1].codes.data_ptr() == fused.codes[64:].data_ptr()
    mixed = [parts[0], kept_linear(decode(random_blocks("Q8_0", 64, 256), "Q8_0"), None)]
    assert not isinstance(fuse_linears(mixed), Int8Linear)  # scales per 16 and per 32


def test_q_and_k_rows_follow_transformers_rope_order():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    for name, heads in (("blk.0.attn_q.weight", 4), ("blk.0.attn_k.weight", 2)):
        rows = heads * 16
        loaded = processor.process(weights=np.arange(rows)[:, None], name=name).weights
        assert rope_rows(rows, heads).tolist() == loaded[:, 0].tolist()


# the tiny GGUF's decoder linears: every kept type, and two that are not (F16, Q3_K)
TINY_TYPES = {
    0: {"attn_q": "Q4_0", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0",
        "ffn_gate": "Q5_K", "ffn_up": "Q5_0", "ffn_down": "Q5_1"},
    1: {"attn_q": "Q4_1", "attn_k": "Q5_K", "attn_v": "F16", "attn_output": "Q4_K",
        "ffn_gate": "Q6_K", "ffn_up": "Q3_K", "ffn_down": "Q4_K"},
}  # fmt: skip
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2  # K-quants' blocks are 256 inputs


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama GGUF with TINY_TYPES' linears, the embedded model's tokenizer and a
    Q8_0 token embedding that the output head is tied to."""
    import gguf

    embedded = gguf.GGUFReader(embedded_model_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(len(TINY_TYPES))
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    for field in embedded.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    vocab = len(embedded.fields["tokenizer.ggml.tokens"].data)
    quant = gguf.GGMLQuantizationType
    writer.add_tensor(
        "token_embd.weight", random_blocks("Q8_0", vocab, HIDDEN), raw_dtype=quant.Q8_0
    )
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    rng = np.random.default_rng(5)
    for layer, types in TINY_TYPES.items():
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, np.float32))
        for seed, (part, kind) in enumerate(types.items()):
            name, (rows, cols) = f"blk.{layer}.{part}.weight", shapes[part]
            if kind == "F16":
                writer.add_tensor(name, rng.normal(0, 0.05, (rows, cols)).astype(np.float16))
            else:
                raw = random_blocks(kind, rows, cols, seed=10 * layer + seed)
                writer.add_tensor(name, raw, raw_dtype=quant[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@kernels_built
async def test_a_gguf_keeps_each_linear_on_its_file_grid(tiny_gguf, make_engine):
    loaded = load_model(EngineConfig(model=str(tiny_gguf)))
    assert (loaded.linear_dtype, loaded.kv_dtype) == ("gguf", "float16")
    reference = load_model(EngineConfig(model=str(tiny_gguf), linear_dtype="float32")).model
    assert reference.config.tie_word_embeddings
    modules, weights = dict(loaded.model.named_modules()), dict(reference.named_modules())
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # fmt: skip
    torch.manual_seed(0)
    for layer, types in TINY_TYPES.items():
        for part, kind in types.items():
            name = f"model.layers.{layer}.{names[part]}"
            module, weight = modules[name], weights[name].weight.detach()
            if kind in ("F16", "Q3_K"):
                assert type(module) is torch.nn.Linear, name  # kept as loaded
                continue
            assert isinstance(module, Int4Linear if kind.startswith("Q4") else Int8Linear), name
            x = torch.randn(2, module.in_features)
            assert relative_error(small_matmul(module)(x), x @ weight.t()) < 2e-4, name
    head = loaded.model.lm_head
    assert isinstance(head, Int8Linear) and head.dense is None  # the file's Q8_0 embedding
    x = torch.randn(1, HIDDEN)
    assert relative_error(head(x), x @ reference.lm_head.weight.detach().t()) < 2e-4
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32
    engine = make_engine(loaded=loaded)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    deltas = [d async for d in engine.generate("r", "Hello there", sampling)]
    assert deltas[-1].completion_tokens == 5


def test_only_files_with_kept_types_resolve_to_gguf(tiny_gguf, tmp_path):
    import gguf

    cpu = torch.device("cpu")
    assert gguf_kept_types(tiny_gguf) == set(KEPT_TYPES)
    assert resolve_precision(
        EngineConfig(), str(tiny_gguf.parent), {"gguf_file": tiny_gguf.name}, cpu
    ) == ("gguf", "float16")
    writer = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_kept_types(tmp_path / "f16.gguf") == set()
    kwargs = {"gguf_file": "f16.gguf"}
    assert resolve_precision(EngineConfig(), str(tmp_path), kwargs, cpu) == ("auto", "model")
