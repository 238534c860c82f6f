from engine.runner.detokenize import (
    REPLACEMENT,
    Detokenizer,
    IncrementalDecoder,
    StopStringFilter,
    token_bytes,
)


def stream(tokenizer, ids, stop=()):
    detok = Detokenizer(tokenizer, stop)
    pieces = []
    for i in ids:
        pieces.append(detok.add(i))
        if detok.stopped:
            return pieces, True
    pieces.append(detok.finish())
    return pieces, False


def test_emoji_split_across_tokens_is_emitted_whole(tokenizer):
    text = "I like 🦙 and ✨ café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the emoji really spans several byte tokens
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + decoder.flush() == text
    assert "🦙" in pieces[[i for i, p in enumerate(pieces) if "🦙" in p][0]]


def test_token_bytes_of_a_partial_character(tokenizer):
    ids = tokenizer.encode(" 🦙", add_special_tokens=False)
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == " 🦙".encode()


def test_stop_string_across_token_boundaries(tokenizer):
    text = "The answer is forty-two. Next question please"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, stopped = stream(tokenizer, ids, stop=("two. Next",))
    assert stopped
    assert "".join(pieces) == "The answer is forty-"


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    text = "alpha beta gam"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, stopped = stream(tokenizer, ids, stop=("gamma ray",))
    assert not stopped
    assert "".join(pieces) == text
    assert "gam" not in "".join(pieces[:-1])  # held back until generation ended


def test_stop_filter_never_leaks_a_prefix():
    stop = StopStringFilter(("<END>",))
    assert stop.add("hello <") == "hello "
    assert stop.add("EN") == ""
    assert stop.add("D> ignored") == ""
    assert stop.stopped
    assert stop.flush() == ""


def test_earliest_stop_string_wins():
    stop = StopStringFilter(("yz", "b"))
    assert stop.add("abcxyz") == "a"
    assert stop.stopped
