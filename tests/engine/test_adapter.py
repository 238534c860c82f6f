"""Answer adapters (engine/runner/adapter.py): a LoRA on q, k and v that the lean decode step
applies to the rows that name it. An adapted step is transformers' forward with the LoRA
added to q_proj, k_proj and v_proj (float and int4 one-call layers alike); rows without it in
the same batch step as they would alone; a Generation reads its prompt with the base model
but the last `lead` tokens; an engine serves the adapter as "<model id>:<name>" on every
path, and refuses a name it does not serve or a file that does not fit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import save_file

from engine.protocol import InvalidRequest, MemorySpec, SamplingParams
from engine.runner.adapter import AdapterError, read_adapter
from engine.runner.decode_state import KVCacheState, decode_batch, forward_kv
from engine.runner.decode_step import decoder_of
from engine.runner.generate import Generation
from tests.engine.test_decode_step import tiny_llama

TARGETS = ("q", "k", "v")


def write_adapter(path, model, rank=4, alpha=8.0, lead=3, scale=0.3, seed=1, zero=False):
    """A random adapter for `model` (B zero with `zero`), saved as `longserve adapt` saves."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        for target in TARGETS:
            linear = getattr(layer.self_attn, f"{target}_proj")
            a = torch.randn(rank, linear.in_features, generator=gen) * scale
            b = torch.randn(linear.out_features, rank, generator=gen) * scale
            tensors[f"layers.{i}.{target}.A"] = a.half()
            tensors[f"layers.{i}.{target}.B"] = (b * 0 if zero else b).half()
    meta = {"rank": str(rank), "alpha": str(alpha), "lead": str(lead)}
    save_file(tensors, str(path), metadata=meta)
    return path


@contextlib.contextmanager
def lora_hooks(model, adapter_file):
    """transformers' forward with the file's LoRA added to every q_proj, k_proj, v_proj."""
    from safetensors.torch import load_file

    tensors = load_file(str(adapter_file))
    from safetensors import safe_open

    with safe_open(str(adapter_file), framework="pt") as f:
        meta = f.metadata()
    scaling = float(meta["alpha"]) / int(meta["rank"])
    handles = []
    for i, layer in enumerate(model.model.layers):
        for target in TARGETS:
            a = tensors[f"layers.{i}.{target}.A"].float()
            b = tensors[f"layers.{i}.{target}.B"].float()

            def hook(_m, args, out, a=a, b=b):
                return out + (args[0].float() @ a.T @ b.T * scaling).to(out.dtype)

            linear = getattr(layer.self_attn, f"{target}_proj")
            handles.append(linear.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def prefilled(model, n=40):
    state = KVCacheState(model, 1024)
    with torch.inference_mode():
        state.prefill(torch.arange(n) % 300)
    return state


def test_an_adapted_step_is_transformers_forward_with_the_lora(tmp_path):
    model = tiny_llama()
    path = write_adapter(tmp_path / "a.safetensors", model)
    adapter = read_adapter(path, model)
    lean, ref, base = prefilled(model), prefilled(model), prefilled(model)
    with torch.inference_mode():
        for token in (5, 17, 299):
            got = adapter.step(lean, token)
            with lora_hooks(model, path):
                want = forward_kv(model, [ref], torch.tensor([[token]]))[0]
            plain = base.step(token)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert (got - plain).abs().max() > 1e-2  # the adapter changes the logits


def test_int4_one_call_layers_turn_the_update_as_the_python_layers(tmp_path):
    """The one-call pre_attention kernel hands q and k back turned by the rotary; the update
    is turned the same way before it joins them."""
    model = tiny_llama("int4")
    decoder = decoder_of(model)
    if decoder._q4 is None:
        pytest.skip("no C++ compiler or ninja: the one-call layers are not built")
    adapter = read_adapter(write_adapter(tmp_path / "a.safetensors", model), model)
    fused, python = prefilled(model), prefilled(model)
    with torch.inference_mode():
        for token in (9, 17, 4):
            got = adapter.step(fused, token)
            q4, decoder._q4 = decoder._q4, None
            want = adapter.step(python, token)
            decoder._q4 = q4
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * float(want.abs().max()))


def test_rows_with_and_without_the_adapter_step_as_they_would_alone(tmp_path):
    model = tiny_llama("int4")
    adapter = read_adapter(write_adapter(tmp_path / "a.safetensors", model), model)
    together = [prefilled(model, n) for n in (30, 47, 12)]
    alone = [prefilled(model, n) for n in (30, 47, 12)]
    adapters = [adapter, None, adapter]
    with torch.inference_mode():
        for token in (9, 17):
            got = decode_batch(model, together, [token] * 3, adapters)
            for b, (state, a) in enumerate(zip(alone, adapters, strict=True)):
                want = state.step(token) if a is None else a.step(state, token)
                torch.testing.assert_close(got[b], want, rtol=0, atol=0)


def test_a_zero_update_changes_nothing(tmp_path):
    model = tiny_llama()
    adapter = read_adapter(write_adapter(tmp_path / "z.safetensors", model, zero=True), model)
    a, b = prefilled(model), prefilled(model)
    with torch.inference_mode():
        torch.testing.assert_close(adapter.step(a, 7), b.step(7), rtol=0, atol=0)


def test_a_generation_reads_the_prompt_with_the_base_but_its_last_lead_tokens(
    tmp_path, tiny_loaded
):
    model, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    adapter = read_adapter(write_adapter(tmp_path / "a.safetensors", model, lead=3), model)
    ids = torch.tensor(tokenizer.encode("Once upon a time, in a land far away,"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    state = KVCacheState(model)
    deltas = [d for d in Generation(state, ids, greedy, tokenizer, adapter=adapter) if d]
    got = [t for d in deltas for t in d.token_ids]
    manual, tokens = KVCacheState(model), []
    with torch.inference_mode():
        manual.prefill(ids[:-3])
        for token in ids[-3:].tolist():
            logits = adapter.step(manual, token)
        for _ in range(6):
            tokens.append(int(logits.argmax()))
            logits = adapter.step(manual, tokens[-1])
    assert got == tokens
    plain = [d for d in Generation(KVCacheState(model), ids, greedy, tokenizer) if d]
    assert got != [t for d in plain for t in d.token_ids]


def test_a_file_that_does_not_fit_is_refused(tmp_path):
    small, other = tiny_llama(), tiny_llama(hidden_size=64, num_attention_heads=2)
    path = write_adapter(tmp_path / "a.safetensors", small)
    with pytest.raises(AdapterError, match="does not fit"):
        read_adapter(path, other)
    fused = tiny_llama()
    for layer in fused.model.layers:  # Phi-3 keeps q|k|v as one qkv_proj
        del layer.self_attn.q_proj
    with pytest.raises(AdapterError, match="no separate q, k, v"):
        read_adapter(path, fused)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot read"):
        read_adapter(tmp_path / "junk.safetensors", small)


async def collect(stream):
    return [d async for d in stream]


async def test_an_engine_serves_the_adapter_on_every_path(
    tmp_path, make_engine, tiny_loaded, small_memory_spec
):
    path = write_adapter(tmp_path / "recall.safetensors", tiny_loaded.model)
    engine = make_engine(adapters=(f"mine={path}",))
    name = f"{tiny_loaded.model_id}:mine"
    assert name in engine.model.adapters
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = [{"role": "user", "content": "Tell me about the sea."}]

    def text(deltas):
        return "".join(d.text for d in deltas)

    base = text(await collect(engine.generate("r1", prompt, greedy)))
    adapted = text(await collect(engine.generate("r2", prompt, greedy, adapter=name)))
    assert adapted != base
    assert text(await collect(engine.generate("r3", prompt, greedy, adapter=name))) == adapted
    await engine.create_session("s", small_memory_spec)
    deltas = await collect(engine.generate("r4", prompt, greedy, session_id="s", adapter=name))
    assert deltas[-1].finish_reason == "length"
    long = [{"role": "user", "content": "word " * 400 + "Tell me about the sea."}]
    spec = MemorySpec("segments", small_memory_spec.params)
    deltas = await collect(engine.generate("r5", long, greedy, memory=spec, adapter=name))
    assert deltas[-1].finish_reason == "length"
    with pytest.raises(InvalidRequest, match="no adapter model"):
        engine.generate("r6", prompt, greedy, adapter=f"{tiny_loaded.model_id}:other")


async def test_kept_prefixes_hold_only_what_the_base_model_read(tmp_path, make_engine, tiny_loaded):
    """A plain request with the adapter reuses and keeps whole blocks of its prompt but the
    adapted tail, so base and adapted requests share them and answer as without reuse."""
    path = write_adapter(tmp_path / "recall.safetensors", tiny_loaded.model)
    name = f"{tiny_loaded.model_id}:recall"
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = [{"role": "user", "content": "the tide " * 60 + "Tell me about the sea."}]

    async def text(engine, rid, adapter=None):
        return "".join(
            d.text for d in await collect(engine.generate(rid, prompt, greedy, adapter=adapter))
        )

    fresh = [make_engine(adapters=(str(path),), prefill_chunk_tokens=64) for _ in range(2)]
    want_adapted = await text(fresh[0], "a", name)
    want_base = await text(fresh[1], "b")
    shared = make_engine(adapters=(str(path),), prefill_chunk_tokens=64)
    assert await text(shared, "1", name) == want_adapted
    assert await text(shared, "2") == want_base
    assert await text(shared, "3", name) == want_adapted
    assert shared.stats().prefix_cache_hits >= 2
