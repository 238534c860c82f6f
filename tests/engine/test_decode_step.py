"""The lean decode step (engine/runner/decode_step.py) computes transformers' forward: the same logits
for one row and for rows of different lengths, through fused linears that share the model's
weights, with the CPU attention kernel (engine/runner/cpu_attention.py) equal to SDPA; a failed step
changes no cache. On tiny random models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from engine.runner import quant_linears
from engine.runner.attention import use_longserve_attention
from engine.runner.cpu_attention import decode_attention, load_kernel
from engine.runner.decode_state import KVCacheState, forward_kv
from engine.runner.decode_step import (
    DECODER_ATTR,
    attach_decoder,
    decode_rows,
    decoder_of,
    unsupported,
)
from engine.runner.kv_cache import KVCache
from engine.runner.quant_linears import SMALL_M, Int4Linear, Int8Linear
from engine.runner.rows import KVRow
from engine.runner.weights import _Concat, fuse_linears, lower_linear_weights

SMALL = dict(
    vocab_size=300,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32; q 128 rows, k and v 64 each
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def tiny_llama(linear_dtype: str | None = None, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, **overrides})).eval()
    if linear_dtype is not None:
        lower_linear_weights(model, linear_dtype)
    use_longserve_attention(model)
    attach_decoder(model)
    return model


def without_decoder(model):
    """The same model with transformers' forward for every step (the reference)."""

    class Plain:
        def __init__(self) -> None:
            self.__dict__[DECODER_ATTR] = None

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *args, **kwargs):
            return model(*args, **kwargs)

    return Plain()


@pytest.mark.parametrize("prompt_len", [1, 40, 600])  # 600: several of the kernel's key chunks
def test_one_row_matches_transformers_forward(prompt_len):
    model = tiny_llama()
    assert decoder_of(model) is not None
    ids = torch.randint(0, 300, (prompt_len,), generator=torch.Generator().manual_seed(1))
    lean, plain = KVCacheState(model, 1024), KVCacheState(model, 1024)
    with torch.inference_mode():
        lean.prefill(ids)
        plain.prefill(ids)
        for token in (5, 17, 299, 3):
            got = lean.step(token)  # the lean step
            want = forward_kv(model, [plain], torch.tensor([[token]]))[0]  # transformers'
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert lean.num_tokens == plain.num_tokens == prompt_len + 4


def test_rows_of_different_lengths_match_transformers_forward():
    model = tiny_llama()
    reference = without_decoder(model)
    lens = (3, 70, 300)
    caches: dict[str, list[KVCache]] = {"lean": [], "plain": []}
    with torch.inference_mode():
        for name in caches:
            for n in lens:
                state = KVCacheState(model, 1024)
                state.prefill(torch.arange(n) % 300)
                caches[name].append(state.cache)
        for step in range(3):
            tokens = [7 + step, 100, 250 - step]
            got = decode_rows(model, [KVRow(c) for c in caches["lean"]], tokens)
            want = decode_rows(reference, [KVRow(c) for c in caches["plain"]], tokens)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [c.num_tokens for c in caches["lean"]] == [n + 3 for n in lens]


def test_fused_linears_share_the_models_weights():
    model = tiny_llama()
    attn = model.model.layers[0].self_attn
    qkv = decoder_of(model).layers[0][1]
    assert isinstance(qkv, torch.nn.Linear) and qkv.out_features == 128 + 64 + 64
    base = qkv.weight.untyped_storage().data_ptr()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == base  # a view, no second copy
    x = torch.randn(2, 128)
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
    torch.testing.assert_close(qkv(x), want)


@pytest.mark.parametrize("ours", [True, False])
def test_int4_parts_fuse_where_their_codes_concatenate(monkeypatch, ours):
    """With engine/runner/csrc/quant_matmul.cpp, any int4 parts fuse (its codes are plain rows);
    with torch's int4 kernel only parts whose packed rows concatenate do."""
    if ours and quant_linears.quant_kernels() is None:
        pytest.skip("no C++ compiler or ninja to build the kernel")
    if not ours:
        monkeypatch.setattr(quant_linears, "quant_kernels", lambda: None)
    torch.manual_seed(0)
    x = torch.randn(3, 128)
    whole = [Int4Linear(torch.nn.Linear(128, n, bias=False)) for n in (128, 64)]
    want = torch.cat([p(x) for p in whole], -1)
    fused = fuse_linears(whole)
    assert isinstance(fused, Int4Linear) and fused.out_features == 192
    torch.testing.assert_close(fused(x), want)
    # torch's AVX-512 layout packs rows in blocks of 64: a first part of 96 rows does not
    # concatenate there (a probe finds out), and the parts are called one by one
    small = [Int4Linear(torch.nn.Linear(64, n, bias=False)) for n in (96, 32)]
    x = torch.randn(3, 64)
    want = torch.cat([p(x) for p in small], -1)
    fused = fuse_linears(small)
    assert isinstance(fused, Int4Linear if ours else Int4Linear | _Concat)
    torch.testing.assert_close(fused(x), want)


@pytest.mark.parametrize("linear_dtype", ["int4", torch.bfloat16])
def test_lower_precision_linears_step_as_transformers_does(linear_dtype):
    model = tiny_llama(linear_dtype)
    ids = torch.arange(50) % 300
    lean, plain = KVCacheState(model, 1024), KVCacheState(model, 1024)
    with torch.inference_mode():
        lean.prefill(ids)
        plain.prefill(ids)
        got = lean.step(9)
        want = forward_kv(model, [plain], torch.tensor([[9]]))[0]
    # the same bf16 products, summed in another order: within bf16 rounding of the logits
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_a_bfloat16_model_steps_as_transformers_does():
    """A model held in bfloat16 throughout (the default on a GPU): queries and keys are
    rotated in float32, and what the rows attend comes back to the model's dtype before o."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval().to(torch.bfloat16)
    use_longserve_attention(model)  # as load_model does: in the model's dtype, then these
    attach_decoder(model)
    ids = torch.arange(50) % 300
    lean, plain = KVCacheState(model, 1024), KVCacheState(model, 1024)
    with torch.inference_mode():
        lean.prefill(ids)
        plain.prefill(ids)
        for token in (9, 17):
            got = lean.step(token)
            want = forward_kv(model, [plain], torch.tensor([[token]]))[0]
            assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.skipif(quant_linears.quant_kernels() is None, reason="no C++ compiler or ninja")
def test_int4_layers_in_one_call_each_step_as_the_python_layers():
    """quant_matmul.cpp's pre_attention / post_attention (norm, q|k|v, rotary; o, norm, gated
    MLP, residuals) give the step the layers written out in torch ops give, for a batch."""
    model = tiny_llama("int4")
    decoder = decoder_of(model)
    assert decoder._q4 is not None
    _steps_as_the_python_layers(model, decoder)


def _steps_as_the_python_layers(model, decoder) -> None:
    """Three rows, three batched steps: the one-call layers' logits against the same steps
    with them turned off (the layers written out in torch ops)."""
    prompts = [torch.arange(n) % 300 for n in (30, 47, 12)]
    fused = [KVCacheState(model, 1024) for _ in prompts]
    python = [KVCacheState(model, 1024) for _ in prompts]
    with torch.inference_mode():
        for a, b, ids in zip(fused, python, prompts, strict=True):
            a.prefill(ids)
            b.prefill(ids)
        for token in (9, 17, 4):
            got = decode_rows(model, [s.decode_row(token) for s in fused], [token] * 3)
            q4, decoder._q4 = decoder._q4, None
            want = decode_rows(model, [s.decode_row(token) for s in python], [token] * 3)
            decoder._q4 = q4
            # the same products; rms and rotary summed in another order, which attention
            # may amplify a little
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * float(want.abs().max()))


@pytest.mark.skipif(quant_linears.quant_kernels() is None, reason="no C++ compiler or ninja")
@pytest.mark.parametrize("kv_dtype", ["model", "float16"])
def test_plain_rows_step_all_layers_in_one_call_as_layer_by_layer(kv_dtype):
    """plain_step.cpp runs every layer of plain KV rows' step in one call: bit for bit the
    logits and the caches the layer-by-layer calls give (a row's answer does not depend on
    whether a memory row shares its step), for one row and for rows of different lengths (one
    long enough for several key chunks; eight rows, whose tasks take several chunks each while
    a lone row's take one: group_chunks)."""
    model = tiny_llama("int4")
    decoder = decoder_of(model)
    assert decoder._plain is not None
    for lengths in ((30,), (30, 600, 12), (30, 2000, 12, 5, 700, 64, 1500, 300)):
        prompts = [torch.arange(n) % 300 for n in lengths]
        one_call = [KVCacheState(model, 2048, kv_dtype) for _ in prompts]
        by_layer = [KVCacheState(model, 2048, kv_dtype) for _ in prompts]
        with torch.inference_mode():
            for a, b, ids in zip(one_call, by_layer, prompts, strict=True):
                a.prefill(ids)
                b.prefill(ids)
            for token in (9, 17, 4):
                tokens = [token] * len(prompts)
                got = decode_rows(model, [s.decode_row(token) for s in one_call], tokens)
                plain, decoder._plain = decoder._plain, None
                want = decode_rows(model, [s.decode_row(token) for s in by_layer], tokens)
                decoder._plain = plain
                # the same kernels: bit for bit
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(one_call, by_layer, strict=True):
            assert a.num_tokens == b.num_tokens
            torch.testing.assert_close(a.cache.layer_view(1), b.cache.layer_view(1))


def int8_grid(weight: torch.Tensor, per: int, with_mins: bool) -> Int8Linear:
    """weight (N, K) on an int8 grid as a GGUF holds its 5- to 8-bit types: codes 0..31 on each
    block's [min, max] with a minimum (Q5_K-like, per 32), or symmetric codes per `per` inputs
    (Q6_K-like per 16)."""
    n, k = weight.shape
    blocks = weight.detach().reshape(n, -1, per)
    if with_mins:
        low = blocks.amin(-1)
        scale = (blocks.amax(-1) - low) / 31
        codes = ((blocks - low[..., None]) / scale[..., None]).round()
        return Int8Linear.from_grid(codes.reshape(n, k).to(torch.int8), scale, low)
    scale = blocks.abs().amax(-1) / 31
    codes = (blocks / scale[..., None]).round()
    return Int8Linear.from_grid(codes.reshape(n, k).to(torch.int8), scale, None)


@pytest.mark.skipif(quant_linears.quant_kernels() is None, reason="no C++ compiler or ninja")
def test_int8_layers_in_one_call_each_step_as_the_python_layers():
    """A GGUF's int8 grids (scales per 16, minimums per 32) take pre_attention / post_attention
    too, and step as the layers written out in torch ops do."""
    model = tiny_llama()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, int8_grid(getattr(attn, name).weight, 16, with_mins=False))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, int8_grid(getattr(mlp, name).weight, 32, with_mins=True))
    model.lm_head = Int8Linear(model.lm_head)  # as a GGUF's head is kept
    decoder = attach_decoder(model)
    assert decoder is not None and decoder._q4 is not None
    assert all(pre is not None and post is not None for pre, post in decoder._q4[1])
    assert decoder.invariant_rows == SMALL_M
    _steps_as_the_python_layers(model, decoder)


def test_a_failed_step_changes_no_cache():
    model = tiny_llama()
    state = KVCacheState(model, 1024)
    with torch.inference_mode():
        state.prefill(torch.arange(20))
        before = state.cache._buffer.clone()
        decoder = decoder_of(model)
        w_in, qkv, o_proj, w_post, gate_up, down = decoder.small[1]  # one row: the small table

        def broken(x):
            raise RuntimeError("boom")

        decoder.small[1] = (w_in, qkv, o_proj, w_post, gate_up, broken)
        with pytest.raises(RuntimeError, match="boom"):
            state.step(4)
        decoder.small[1] = (w_in, qkv, o_proj, w_post, gate_up, down)
        assert state.num_tokens == 20
        assert torch.equal(state.cache._buffer[:, :, :, :20], before[:, :, :, :20])
        state.step(4)  # the cache takes the step again
    assert state.num_tokens == 21


def test_other_architectures_keep_transformers_forward():
    """The families with a lean step, and what each refuses: tests/engine/test_families.py."""
    gpt2 = GPT2Config(
        vocab_size=300, n_embd=128, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2
    )
    model = GPT2LMHeadModel(gpt2).eval()
    assert "GPT2LMHeadModel is not one of" in unsupported(model)
    assert attach_decoder(model) is None and decoder_of(model) is None
    dynamic = {"rope_type": "dynamic", "factor": 2.0}  # angles that follow the length
    llama = LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling=dynamic))
    assert "rotary" in unsupported(llama)


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler or ninja to build the kernel")
@pytest.mark.parametrize("keys", [1, 7, 255, 1000])
@pytest.mark.parametrize("group", [1, 2, 3, 4])  # up to 3 read each key once (AVX2, AVX-512)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cpu_kernel_is_sdpa(keys, group, dtype):
    """float16 keys and values (a float16 KV cache) are widened as read: SDPA over the same
    values in float32."""
    torch.manual_seed(keys)
    query = torch.randn(2, group, 64)
    buffer = torch.randn(2, 2, 1200, 64).to(dtype)  # a cache's (2, kv_heads, capacity, d)
    keys_, values = buffer[0, :, :keys], buffer[1, :, :keys]  # strided views
    want = F.scaled_dot_product_attention(
        query[None], keys_[None].float(), values[None].float(), scale=0.125
    )
    got = decode_attention(query, keys_, values, 0.125)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler or ninja to build the kernel")
# no 8-wide path; 8 lanes (AVX2; 32 at a time for 64 and 128); 16 lanes with 3 vectors of
# accumulators, or 4 and then 1
@pytest.mark.parametrize("d", [36, 200, 48, 80, 128, 64])
def test_the_cpu_kernel_takes_other_head_dims(d):
    torch.manual_seed(d)
    query, keys, values = torch.randn(2, 3, d), torch.randn(2, 300, d), torch.randn(2, 300, d)
    want = F.scaled_dot_product_attention(query[None], keys[None], values[None], scale=0.1)
    torch.testing.assert_close(
        decode_attention(query, keys, values, 0.1), want[0], rtol=1e-5, atol=1e-5
    )


def test_decode_agreement_bench_finds_the_lean_step_equal_in_fp32(tiny_model_dir, capsys):
    import json

    from bench.decode_agreement import main

    main(["--model", str(tiny_model_dir), "--linear-dtypes", "auto", "--prompts", "2",
          "--context-tokens", "60", "--new-tokens", "4"])  # fmt: skip
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["steps"] == 8 and row["prompts"] == 2
    assert row["lean_vs_transformers"] == 1.0 and row["vs_fp32"] == 1.0


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler or ninja to build the kernel")
@pytest.mark.parametrize("d", [64, 24])  # 16 lanes at a time (AVX-512), or 8 (AVX2)
@pytest.mark.parametrize("group", [3, 1, 2, 5])  # float16 keys read once for a group of <= 3
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_pieces_kernel_is_one_softmax_over_the_concatenated_keys(d, group, dtype):
    from engine.runner.cpu_attention import attend_pieces

    torch.manual_seed(0)
    kvh, block = 2, 16
    sizes = [5, 4 * block, 70, 1]  # sinks, retrieved blocks, window, the token itself
    keys = [torch.randn(kvh, n, d).to(dtype) for n in sizes]
    values = [torch.randn(kvh, n, d).to(dtype) for n in sizes]
    keys[2] = torch.randn(kvh, 100, d).to(dtype)[:, 30:]  # a strided view, as a window's
    q = torch.randn(kvh, 1, group, d)
    q_blocks = torch.randn(kvh, 4, group, d)  # one query per retrieved block
    ok = torch.ones(kvh, 4 * block, dtype=torch.bool)
    ok[0, -block:] = False  # head 0's last block is padding
    ok[1, :block] = False
    queries = [q, q_blocks, q, q]
    got = attend_pieces(queries, keys, values, [None, ok, None, None], 0.125)
    wide_k = [k.float() for k in keys]
    logits = [
        torch.einsum("hgd,hnd->hgn", q[:, 0], wide_k[0]),
        torch.einsum("hbgd,hbnd->hgbn", q_blocks, wide_k[1].view(kvh, 4, block, d)).flatten(2),
        torch.einsum("hgd,hnd->hgn", q[:, 0], wide_k[2]),
        torch.einsum("hgd,hnd->hgn", q[:, 0], wide_k[3]),
    ]
    logits[1] = logits[1].masked_fill(~ok[:, None], float("-inf"))
    weights = (torch.cat(logits, -1) * 0.125).softmax(-1)
    want = weights @ torch.cat([v.float() for v in values], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the pieces' keys split into chunks across threads, chunk edges inside pieces and inside
    # a block's run of keys, a chunk all masked, more chunks than fit: the same softmax
    kernel, no_mask, no_rows = load_kernel(), torch.empty(0, dtype=torch.bool), torch.empty(0)
    masks = [no_mask, ok, no_mask, no_mask]
    for splits in (2, 3, 7, 140, 500):
        no_params = [torch.empty(0, dtype=torch.float16)] * 4
        split = kernel.attend_pieces(queries, keys, values, masks, [no_rows.long()] * 4,
                                     no_params, no_params, 0, 0.125, splits)  # fmt: skip
        torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
    # a piece whose keys are all left out adds nothing
    none = torch.zeros(kvh, 4 * block, dtype=torch.bool)
    alone = attend_pieces([q, q_blocks], keys[:2], values[:2], [None, none], 0.125)
    torch.testing.assert_close(alone, attend_pieces([q], keys[:1], values[:1], [None], 0.125))


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler or ninja to build the kernel")
def test_the_pieces_kernel_reads_memory_rows_in_place():
    from engine.runner.cpu_attention import attend_pieces

    torch.manual_seed(1)
    kvh, group, d = 2, 3, 64
    memory_k, memory_v = torch.randn(kvh, 500, d), torch.randn(kvh, 500, d)
    rows = torch.randint(0, 500, (kvh, 96))
    gathered = [torch.stack([m[h, rows[h]] for h in range(kvh)]) for m in (memory_k, memory_v)]
    q, q_blocks = torch.randn(kvh, 1, group, d), torch.randn(kvh, 6, group, d)
    sinks_k, sinks_v = torch.randn(kvh, 4, d), torch.randn(kvh, 4, d)
    want = attend_pieces(
        [q, q_blocks], [sinks_k, gathered[0]], [sinks_v, gathered[1]], [None, None], 0.125
    )
    got = attend_pieces(
        [q, q_blocks], [sinks_k, memory_k], [sinks_v, memory_v], [None, None], 0.125,
        [None, rows],
    )  # fmt: skip
    torch.testing.assert_close(got, want)
    # float16 memory (memory_dtype): widened as read, the same as its float32 copy
    half_k, half_v = memory_k.half(), memory_v.half()
    got = attend_pieces(
        [q, q_blocks], [sinks_k, half_k], [sinks_v, half_v], [None, None], 0.125, [None, rows]
    )
    want = attend_pieces(
        [q, q_blocks], [sinks_k, half_k.float()], [sinks_v, half_v.float()], [None, None],
        0.125, [None, rows],
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    no_mask = torch.empty(0, dtype=torch.bool)
    for splits in (3, 50):  # chunks of rows read in place, across the pieces' edge
        no_params = [torch.empty(0, dtype=torch.float16)] * 2
        split = load_kernel().attend_pieces(
            [q, q_blocks], [sinks_k, half_k], [sinks_v, half_v], [no_mask, no_mask],
            [torch.empty(0, dtype=torch.long), rows], no_params, no_params, 0, 0.125, splits,
        )  # fmt: skip
        torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float16"):  # keys and values of one dtype
        attend_pieces([q_blocks], [half_k], [memory_v], [None], 0.125, [rows])
    with pytest.raises(RuntimeError, match="outside"):
        bad = rows.clone()
        bad[0, 0] = 500
        attend_pieces([q_blocks], [memory_k], [memory_v], [None], 0.125, [bad])


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler or ninja to build the kernel")
@pytest.mark.parametrize("d", [64, 24])  # scales folded into the query (AVX-512), or widened
def test_the_pieces_kernel_reads_int8_memory_in_place(d):
    """int8 memory blocks (quantized.py) read as codes and scales, dequantized by the kernel as
    it reads them: the attention over their float32 dequantized copy, without the copy."""
    from engine.memory.quantized import QuantizedBuffer
    from engine.runner.cpu_attention import attend_pieces

    torch.manual_seed(2)
    kvh, group, block = 3, 3, 64
    keys = QuantizedBuffer(kvh, d, block, torch.device("cpu"))
    values = QuantizedBuffer(kvh, d, 0, torch.device("cpu"))
    keys.append(torch.randn(kvh, 8 * block, d) * 3)
    values.append(torch.randn(kvh, 8 * block, d))
    keys.drop_front(block)  # rows count from the view's first block, as memory's FIFO leaves it
    values.drop_front(block)
    picked = torch.tensor([[6, 0, 3], [1, 2, 6], [5, 4, 0]])  # whole blocks, any order per head
    rows = (picked[..., None] * block + torch.arange(block)).reshape(kvh, -1)
    q, q_blocks = torch.randn(kvh, 1, group, d), torch.randn(kvh, 3, group, d)
    sinks_k, sinks_v = torch.randn(kvh, 4, d), torch.randn(kvh, 4, d)
    copies = [b.take_to(rows, torch.device("cpu"), torch.float32) for b in (keys, values)]
    want = attend_pieces(
        [q, q_blocks], [sinks_k, copies[0]], [sinks_v, copies[1]], [None, None], 0.125
    )
    params = (keys.params.view(), values.params.view())
    got = attend_pieces(
        [q, q_blocks], [sinks_k, keys.codes.view()], [sinks_v, values.codes.view()],
        [None, None], 0.125, [None, rows], [None, params], block,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    no_mask, no_params = torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.float16)
    for splits in (5, 40):  # chunk edges inside blocks: runs of keys split within a scale group
        split = load_kernel().attend_pieces(
            [q, q_blocks], [sinks_k, keys.codes.view()], [sinks_v, values.codes.view()],
            [no_mask, no_mask], [torch.empty(0, dtype=torch.long), rows],
            [no_params, params[0]], [no_params, params[1]], block, 0.125, splits,
        )  # fmt: skip
        torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="int8 keys need"):  # codes without their scales
        attend_pieces([q_blocks], [keys.codes.view()], [values.codes.view()], [None], 0.125,
                      [rows])  # fmt: skip


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler or ninja to build the kernel")
def test_a_layer_s_rows_attended_in_one_call_are_each_row_alone_bit_for_bit():
    """PiecesBatch (a batched step's memory rows in one kernel call): every row's result is
    exactly its lone call's, whatever rows run beside it (its own key splits), for float32,
    float16 and int8 pieces, rows read in place and masks."""
    from engine.memory.quantized import QuantizedBuffer
    from engine.runner.cpu_attention import PiecesBatch, attend_pieces

    torch.manual_seed(3)
    kvh, group, d, block = 3, 3, 64, 16
    cpu = torch.device("cpu")
    codes_k, codes_v = QuantizedBuffer(kvh, d, block, cpu), QuantizedBuffer(kvh, d, 0, cpu)
    codes_k.append(torch.randn(kvh, 6 * block, d))
    codes_v.append(torch.randn(kvh, 6 * block, d))
    memory = torch.randn(kvh, 300, d).half(), torch.randn(kvh, 300, d).half()
    calls = []
    for r, window in enumerate((40, 700, 3)):  # rows of different lengths: other key splits
        rows = torch.randint(0, 6 if r == 2 else 300 // block, (kvh, 2))
        rows = (rows[..., None] * block + torch.arange(block)).reshape(kvh, -1)
        ok = torch.rand(kvh, 2 * block) > 0.2
        q, q_blocks = torch.randn(kvh, 1, group, d), torch.randn(kvh, 2, group, d)
        sinks = torch.randn(kvh, 4, d), torch.randn(kvh, 4, d)
        own = torch.randn(kvh, window, d).half(), torch.randn(kvh, window, d).half()
        if r == 2:  # int8 memory read in place
            blocks = (codes_k.codes.view(), codes_v.codes.view())
            params = (codes_k.params.view(), codes_v.params.view())
        else:
            blocks, params = memory, None
        calls.append((
            [q, q_blocks, q], [sinks[0], blocks[0], own[0]], [sinks[1], blocks[1], own[1]],
            [None, ok, None], 0.125, [None, rows, None], [None, params, None], block,
        ))  # fmt: skip
    alone = [attend_pieces(*call) for call in calls]
    batch = PiecesBatch()
    deferred = [batch.defer(*call) for call in calls]
    batch.run()
    for want, call in zip(alone, deferred, strict=True):
        assert torch.equal(call.out, want)
    assert batch.calls == []


@pytest.mark.parametrize("lean", [True, False])
def test_a_float16_cache_decodes_as_the_model_within_its_rounding(lean):
    """kv_dtype "float16": the cache holds half-precision keys and values, the kernel widens
    them as it reads (lean step, or transformers' forward through the attention function), and
    a later prefill chunk attends them in float32; the logits stay within float16's rounding of
    the float32 cache's, and a cache of 600 tokens holds half the bytes."""
    model = tiny_llama()
    stepper = model if lean else without_decoder(model)
    full, half = KVCacheState(model, 1024), KVCacheState(model, 1024, kv_dtype="float16")
    ids = torch.arange(600) % 300
    with torch.inference_mode():
        for state in (full, half):
            state.prefill(ids[:300])
        for token in (5, 6, 7):
            want = decode_rows(stepper, [full.decode_row(token)], [token])[0]
            got = decode_rows(stepper, [half.decode_row(token)], [token])[0]
            torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
        want, got = full.prefill(ids[300:]), half.prefill(ids[300:])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
    assert half.cache._buffer.dtype == torch.float16
    assert half.cache.nbytes() * 2 == full.cache.nbytes()


def test_kv_dtype_is_checked():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int8")
