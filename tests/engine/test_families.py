"""The lean decode step (engine/runner/decode_step.py) gives transformers' logits for every
family engine/runner/families.py lists, and a configuration it cannot reproduce keeps
transformers' forward, with the reason. On tiny random models built from configs: biases and
norm weights are drawn too (transformers starts them at 0 and 1, where a missed bias or norm
would not show)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.runner.attention import use_longserve_attention
from engine.runner.decode_state import KVCacheState, forward_kv
from engine.runner.decode_step import attach_decoder, decode_rows, decoder_of, unsupported
from engine.runner.loader import ModelLoadError, model_window
from engine.runner.quant_linears import quant_kernels
from engine.runner.weights import lower_linear_weights

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 16 unless a family sets its own
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}

SUPPORTED = {
    "llama-biased": (LlamaForCausalLM, LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**TINY, sliding_window=None)),
    # a window of max_position_embeddings keys cuts nothing
    "mistral-window-of-every-position": (
        MistralForCausalLM,
        MistralConfig(**TINY, sliding_window=256),
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**TINY, head_dim=24)),  # not hidden / heads
    "phi3": (Phi3ForCausalLM, Phi3Config(**TINY)),
    "phi3-partial-rotary": (Phi3ForCausalLM, Phi3Config(**TINY, rope_parameters=PARTIAL)),
}


def tiny(family: str, linear_dtype: str | None = None) -> torch.nn.Module:
    cls, config = SUPPORTED[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # biases and norm weights
                p.add_(0.3 * torch.randn_like(p))
    if linear_dtype is not None:
        lower_linear_weights(model, linear_dtype)
    use_longserve_attention(model)
    attach_decoder(model)
    return model


def whole_forward(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' forward of the whole sequence, no cache: logits (vocab,) at its end."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("family", SUPPORTED)
def test_one_row_steps_as_transformers_forward(family):
    model = tiny(family)
    assert decoder_of(model) is not None, unsupported(model)
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    state = KVCacheState(model, 256)
    with torch.inference_mode():
        state.prefill(torch.tensor(ids))
        for token in (5, 17, 299, 3):
            got = state.step(token)  # the lean step
            ids.append(token)
            torch.testing.assert_close(got, whole_forward(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", SUPPORTED)
def test_rows_of_different_lengths_step_as_transformers_forward(family):
    model = tiny(family)
    seqs = [[(7 * i + n) % 300 for i in range(n)] for n in (1, 37, 120)]
    states = [KVCacheState(model, 256) for _ in seqs]
    with torch.inference_mode():
        for state, ids in zip(states, seqs, strict=True):
            state.prefill(torch.tensor(ids))
        for step in range(3):
            tokens = [7 + step, 100, 250 - step]
            rows = [s.decode_row(t) for s, t in zip(states, tokens, strict=True)]
            got = decode_rows(model, rows, tokens)
            for b, ids in enumerate(seqs):
                ids.append(tokens[b])
                want = whole_forward(model, ids)
                torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_biased_projections_fuse_into_one_linear_sharing_them():
    model = tiny("qwen2")
    attn = model.model.layers[0].self_attn
    qkv = decoder_of(model).layers[0][1]
    assert isinstance(qkv, torch.nn.Linear) and qkv.bias is not None
    base = qkv.bias.untyped_storage().data_ptr()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias.untyped_storage().data_ptr() == base  # a view, no second copy
    x = torch.randn(2, 64)
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
    torch.testing.assert_close(qkv(x), want)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3-partial-rotary"])
def test_int4_layers_unlike_llamas_skip_the_one_call_kernels(family):
    """quant_matmul.cpp's pre_attention / post_attention compute Llama's layer: q/k norms or
    partial rotary take the layers written out in torch ops, and a biased q|k|v the work
    before attention, which step as transformers' forward on the same int4 weights does."""
    model = tiny(family, "int4")
    q4 = decoder_of(model)._q4
    if family == "qwen2" and quant_kernels() is not None:  # after attention it is Llama's layer
        assert q4 is not None and all(pre is None and post for pre, post in q4[1])
    else:
        assert q4 is None
    ids = torch.arange(50) % 300
    lean, plain = KVCacheState(model, 256), KVCacheState(model, 256)
    with torch.inference_mode():
        lean.prefill(ids)
        plain.prefill(ids)
        got = lean.step(9)
        want = forward_kv(model, [plain], torch.tensor([[9]]))[0]
    # the same bf16 products, summed in another order: within bf16 rounding of the logits
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 8,  # one per pair of the 16 rotary dims
    "long_factor": [2.0] * 8,
    "factor": 2.0,  # max_position_embeddings over the original 128
    "original_max_position_embeddings": 128,
}
REFUSED = {
    "mistral-short-window": (
        MistralForCausalLM,
        MistralConfig(**TINY, sliding_window=64),
        "sliding-window attention on 2 of 2 layers (sliding_window=64 < "
        "max_position_embeddings=256)",
    ),
    "qwen2-sliding-layers": (
        Qwen2ForCausalLM,
        Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=1),
        "sliding-window attention on 1 of 2 layers",
    ),
    "phi3-short-window": (  # Phi-3-mini-4k: 2047 of 4096
        Phi3ForCausalLM,
        Phi3Config(**TINY, sliding_window=127),
        "sliding-window attention on 2 of 2 layers (sliding_window=127",
    ),
    "phi3-longrope": (
        Phi3ForCausalLM,
        Phi3Config(**TINY, rope_parameters=LONGROPE),
        "rope_type 'longrope': rotary angles that depend on the sequence length",
    ),
    "llama-dynamic-rope": (
        LlamaForCausalLM,
        LlamaConfig(**TINY, rope_scaling=DYNAMIC),
        "rope_type 'dynamic'",
    ),
    "llama-gelu": (LlamaForCausalLM, LlamaConfig(**TINY, hidden_act="gelu"), "hidden_act 'gelu'"),
    "qwen2-partial-rotary": (
        Qwen2ForCausalLM,
        Qwen2Config(**TINY, rope_parameters=PARTIAL),
        "partial_rotary_factor 0.5 on Qwen2ForCausalLM",
    ),
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config(**TINY, head_dim=16),
        "attention logit soft-capping (attn_logit_softcapping=50.0)",
    ),
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(**TINY, head_dim=16, sliding_window=64),
        "sliding-window attention on 2 of 2 layers (sliding_window=64",
    ),
    "gemma3-no-window": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(**TINY, head_dim=16, sliding_window=256),
        "Gemma3ForCausalLM is not one of the lean step's families",
    ),
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2),
        "GPT2LMHeadModel is not one of the lean step's families",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_lean_step_cannot_reproduce_keeps_transformers_forward(case):
    cls, config, reason = REFUSED[case]
    with torch.device("meta"):  # no weights needed: the decision reads the config
        model = cls(config)
    assert reason in unsupported(model)
    assert attach_decoder(model) is None and decoder_of(model) is None


WINDOWS = {  # config -> the window of one forward with no max_model_len asked
    "llama": (LlamaConfig(**TINY), 256),
    "mistral-short-window": (MistralConfig(**TINY, sliding_window=64), 64),
    "qwen2-sliding-layers": (
        Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=1),
        64,
    ),
    "qwen2-no-window": (Qwen2Config(**TINY), 256),
    "gemma3": (Gemma3TextConfig(**TINY, head_dim=16, sliding_window=64), 64),
}


@pytest.mark.parametrize("case", WINDOWS)
def test_a_forward_never_reaches_past_a_sliding_window(case):
    """longserve's attention reads every key it holds: a model whose layers would drop keys
    past a sliding window gets that window as its max_model_len (longer prompts go through
    memory), and asking for more is refused."""
    config, window = WINDOWS[case]
    assert model_window(config, None) == window
    assert model_window(config, 32) == 32
    with pytest.raises(ModelLoadError, match="sliding window|trained window"):
        model_window(config, window + 1)


def test_soft_capped_attention_is_refused_at_load():
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping=50.0"):
        model_window(Gemma2Config(**TINY, head_dim=16), None)
