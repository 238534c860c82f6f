"""Numbers copied, not invented (memory knob `copy_numbers`, engine/runner/copy_numbers.py).

The mask's rules on SmolLM2's digit tokens; a greedy answer from the tiny model pushed to write
digits, whose long runs are then all copies of the source's numbers; the knob checked and
refused where the tokenizer merges digits. Whether answers improve is `bench recall`'s business
(docs/decisions/098-numbers-copied.md)."""

from __future__ import annotations

import re

import pytest
import torch

from engine.memory.config import parse_memory_spec
from engine.protocol import InvalidRequest, MemorySpec, SamplingParams
from engine.runner.copy_numbers import NumberCopy, digit_tokens, numbers_in
from engine.runner.decode_state import KVCacheState
from engine.runner.generate import Generation
from tests.engine.test_frame_text import SPEC


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_smollm2_gives_each_digit_a_token(tokenizer):
    digits = digit_tokens(tokenizer)
    assert digits is not None
    assert [tokenizer.decode([t]) for t in digits] == list("0123456789")


class _MergedDigits:
    """A tokenizer with a two-digit token, as Llama 3's has."""

    def encode(self, text, add_special_tokens=False):
        return [ord(text) - ord("0")]

    def __len__(self):
        return 11

    def convert_ids_to_tokens(self, ids):
        return [*"0123456789", "42"][: len(ids)]


def test_merged_digit_tokens_are_not_supported():
    assert digit_tokens(_MergedDigits()) is None


def test_the_source_s_numbers_are_its_long_digit_runs(tokenizer):
    digits = digit_tokens(tokenizer)
    ids = _ids(tokenizer, "Codes 5835475 and 812-2226, year 2019, v1.5; 7007695.")
    assert numbers_in(ids, digits, 5) == ["5835475", "7007695"]
    assert numbers_in(ids, digits, 3) == ["5835475", "812", "2226", "2019", "7007695"]


def _finite_digits(mask: torch.Tensor, digits) -> str:
    return "".join(str(d) for d, t in enumerate(digits) if torch.isfinite(mask[t]))


def test_a_long_run_follows_a_source_number_and_ends_where_it_ends(tokenizer):
    digits = digit_tokens(tokenizer)
    source = _ids(tokenizer, "The codes are 5835475, 5835601 and 8122226 (and 12).")
    copy = NumberCopy(digits, source, 5)
    logits = torch.zeros(len(tokenizer))
    comma = _ids(tokenizer, ",")[0]

    def write(text: str) -> None:
        for token in _ids(tokenizer, text):
            copy.advance(token)

    assert copy.mask(logits) is logits  # no run yet: free
    write("5")
    write("83")
    assert copy.mask(logits) is logits  # 3 digits, the 4th still leaves it short
    write("5")
    mask = copy.mask(logits)
    assert _finite_digits(mask, digits) == "46"  # 58354..., 58356...
    assert torch.isfinite(mask[comma])  # 4 digits: may still end
    write("47")
    mask = copy.mask(logits)
    assert _finite_digits(mask, digits) == "5"  # only 5835475 goes on
    assert not torch.isfinite(mask[comma])  # 583547 is no number of the source
    write("5")
    mask = copy.mask(logits)
    assert _finite_digits(mask, digits) == ""  # 5835476 would be counting on
    assert torch.isfinite(mask[comma])  # the number is whole
    write(", 9")  # a new run; short ones stay free
    assert copy.mask(logits) is logits


def _counting_on(loaded, copy: NumberCopy | None) -> str:
    """A greedy answer of the tiny model pushed to write digits, each run spelling 5835476...
    (counting on from the source's 5835475), with `copy` as its number_copy."""
    tokenizer, model = loaded.tokenizer, loaded.model
    digits = digit_tokens(tokenizer)
    assert digits is not None
    vocab = model.config.vocab_size
    spelled = "58354769999999"

    class CountingOn(KVCacheState):
        number_copy = copy
        run = 0  # digits written since the last other token

        def _pushed(self, logits):
            push = torch.zeros(vocab)
            push[list(digits)] = 30.0  # any digit beats any other token
            push[digits[int(spelled[min(self.run, len(spelled) - 1)])]] = 40.0
            return logits + push

        def prefill(self, input_ids):
            return self._pushed(super().prefill(input_ids))

        def step(self, token_id):
            self.run = self.run + 1 if token_id in digits else 0
            return self._pushed(super().step(token_id))

    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    source = torch.tensor(_ids(tokenizer, "Badges 5835475, 8122226 and 7007695; room 41."))
    steps = Generation(CountingOn(model), source, greedy, tokenizer)
    return "".join(d.text for d in steps if d is not None)


def test_an_answer_counting_on_writes_only_copies(tiny_loaded):
    source = _ids(tiny_loaded.tokenizer, "Badges 5835475, 8122226 and 7007695; room 41.")
    digits = digit_tokens(tiny_loaded.tokenizer)
    assert "58354769" in _counting_on(tiny_loaded, None)  # unmasked, it counts on
    text = _counting_on(tiny_loaded, NumberCopy(digits, source, 5))
    runs = re.findall(r"\d{5,}", text)
    # copied, ended, copied again; the last run may be cut by max_tokens
    assert len(runs) >= 2 and set(runs[:-1]) == {"5835475"}, text
    assert "5835475".startswith(runs[-1]), text


@pytest.mark.parametrize("value", [-1, 33, "5", True, 2.5])
def test_copy_numbers_is_checked(value):
    with pytest.raises(InvalidRequest, match="memory.copy_numbers"):
        parse_memory_spec(MemorySpec("segments", {"copy_numbers": value}), max_positions=8192)


def test_copy_numbers_takes_a_digit_count():
    def parsed(params):
        return parse_memory_spec(MemorySpec("segments", params), max_positions=8192).copy_numbers

    assert parsed({}) == 0
    assert parsed({"copy_numbers": 5}) == 5


async def test_a_tokenizer_that_merges_digits_refuses_the_knob(make_engine):
    engine = make_engine()
    engine._frame_backend.__dict__["_digits"] = None  # as digit_tokens finds for Llama 3
    with pytest.raises(InvalidRequest, match="memory.copy_numbers"):
        await engine.create_session("s", MemorySpec("segments", {**SPEC, "copy_numbers": 5}))
    assert "s" not in engine._frame_backend
    await engine.create_session("t", MemorySpec("segments", SPEC))  # without it: fine
