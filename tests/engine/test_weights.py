"""Linear weights in bfloat16 on a float32 model (engine/runner/weights.py): every linear layer is
swapped, the rest stays float32, logits stay within bf16 rounding of the float32 ones, and the
engine serves with it. On the tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from engine.caches.store import model_fingerprint
from engine.config import EngineConfig
from engine.protocol import SamplingParams
from engine.runner.loader import (
    embedded_model_path,
    gguf_kept_types,
    load_model,
    resolve_precision,
)
from engine.runner.quant_linears import (
    SMALL_M,
    Int4Linear,
    Int8Linear,
    min_max_groups,
    quantize_groups,
)
from engine.runner.weights import LowPrecisionLinear


def test_linear_weights_in_bf16_keep_the_rest_in_fp32(tiny_model_dir, tiny_loaded):
    lowered = load_model(EngineConfig(model=str(tiny_model_dir), linear_dtype="bfloat16"))
    model = lowered.model
    linears = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    assert len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, and the output head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the head's copy is its own
    assert next(model.parameters()).dtype == torch.float32  # what memories and caches follow
    ids = torch.arange(40)[None] + 100
    with torch.inference_mode():
        want = tiny_loaded.model(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert got.dtype == torch.float32
    error = (got - want).abs().max() / want.abs().max()
    assert 0 < error < 0.02, error  # bf16 keeps 8 bits of mantissa
    assert model_fingerprint("m", model) != model_fingerprint("m", tiny_loaded.model)


@pytest.mark.parametrize("linear_dtype", ["bfloat16", "int4"])
async def test_the_engine_serves_with_lower_precision_linears(
    make_engine, tiny_model_dir, small_memory_spec, linear_dtype
):
    loaded = load_model(EngineConfig(model=str(tiny_model_dir), linear_dtype=linear_dtype))
    engine = make_engine(loaded=loaded)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    plain = [d async for d in engine.generate("plain", "Hello there", sampling)]
    assert plain[-1].completion_tokens == 5
    await engine.create_session("s", small_memory_spec)
    messages = [{"role": "user", "content": "word " * 120}]
    on_memory = [d async for d in engine.generate("s1", messages, sampling, session_id="s")]
    assert on_memory[-1].completion_tokens == 5


async def test_start_engine_builds_off_thread_and_raises_its_errors(tiny_model_dir, tmp_path):
    import pytest

    from engine.runner.loader import ModelLoadError
    from engine.start import start_engine

    engine = start_engine(EngineConfig(model=str(tiny_model_dir), device="cpu"))
    try:
        sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        deltas = [d async for d in engine.generate("r", "Hello", sampling)]
        assert deltas[-1].completion_tokens == 3
    finally:
        await engine.shutdown()
    with pytest.raises((ModelLoadError, OSError, ValueError)):
        start_engine(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))


async def test_start_engine_sets_torch_threads_from_the_config(tiny_model_dir):
    """Replicas sharing a machine split its cores (decision 061): threads=N is what torch
    then runs the model's arithmetic on; 0 leaves torch's default."""
    from engine.start import start_engine

    before = torch.get_num_threads()
    try:
        engine = start_engine(EngineConfig(model=str(tiny_model_dir), device="cpu", threads=1))
        await engine.shutdown()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        engine = start_engine(EngineConfig(model=str(tiny_model_dir), device="cpu"))
        await engine.shutdown()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def q4_1_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight on a Q4_1 grid (w = q d + m per group of 32, each group holding codes 0 and
    15, d and m fp16), centred as trained weights are; and its codes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    m = (-7.5 * d + torch.randn(n, k // 32, 1, generator=g) * d).half().float()
    return (q * d + m).reshape(n, k), q.reshape(n, k)


def test_int4_codes_are_the_q4_1_grid_and_both_paths_multiply_them():
    weight, codes = q4_1_weight(96, 128)
    q, scales_and_zeros = quantize_groups(weight, 32)
    assert torch.equal(q, codes.to(torch.int32))
    assert scales_and_zeros.shape == (4, 96, 2) and scales_and_zeros.dtype == torch.bfloat16
    linear = torch.nn.Linear(128, 96, bias=False)
    linear.weight.data = weight
    layer = Int4Linear(linear)
    # the kernels' fp32 scales and minimums give the file's weights back, up to fp32 rounding
    q, scales, mins = min_max_groups(weight, 32)
    assert torch.equal(q, codes.to(torch.int32))
    kept = (q.reshape(96, 4, 32) * scales[..., None] + mins[..., None]).reshape(96, 128)
    torch.testing.assert_close(kept, weight, rtol=1e-6, atol=1e-7)
    assert torch.equal(layer.block_scales, scales) and torch.equal(layer.block_mins, mins)
    torch.testing.assert_close(layer.dense.float(), weight.to(layer.dense.dtype).float())
    for rows in (1, SMALL_M, SMALL_M + 1, 64):  # the int4 kernel, then the bf16 copy
        x = torch.randn(rows, 128)
        want = x @ layer.dense.float().t()
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        assert (got - want).abs().max() / want.abs().max() < 0.02, rows


def test_int4_linears_swap_the_layers_and_the_head_goes_to_int8(tiny_model_dir, tiny_loaded):
    config = EngineConfig(model=str(tiny_model_dir), linear_dtype="int4")
    model = load_model(config).model
    assert len([m for m in model.modules() if isinstance(m, Int4Linear)]) == 2 * 7
    head = model.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.codes.dtype == torch.int8  # GGUF's is Q8_0
    assert next(model.parameters()).dtype == torch.float32
    bf16 = load_model(EngineConfig(model=str(tiny_model_dir), linear_dtype="bfloat16")).model
    assert len({model_fingerprint("m", m) for m in (model, bf16, tiny_loaded.model)}) == 3


def test_auto_precision_keeps_a_q4_1_gguf_as_the_file_holds_it(tiny_model_dir, tmp_path):
    cpu = torch.device("cpu")
    embedded = embedded_model_path()
    assert gguf_kept_types(embedded) == {"Q4_1"}
    source, kwargs = str(embedded.parent), {"gguf_file": embedded.name}
    assert resolve_precision(EngineConfig(), source, kwargs, cpu) == ("gguf", "float16")
    explicit = EngineConfig(linear_dtype="float32")
    assert resolve_precision(explicit, source, kwargs, cpu) == ("float32", "model")
    cached = EngineConfig(kv_dtype="model")
    assert resolve_precision(cached, source, kwargs, cpu) == ("gguf", "model")
    # a checkpoint directory (not a GGUF) and an unreadable GGUF keep the model's dtype
    assert resolve_precision(EngineConfig(), str(tiny_model_dir), {}, cpu) == ("auto", "model")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    assert gguf_kept_types(tmp_path / "broken.gguf") == set()
    loaded = load_model(EngineConfig(model=str(tiny_model_dir)))
    assert (loaded.linear_dtype, loaded.kv_dtype) == ("auto", "model")
