"""Stopping rules and streaming on real models."""

from __future__ import annotations

import pytest

from prompts import CHAT, CODE, COPY


@pytest.fixture(scope="module")
def reference(plain):
    return plain.generate(CODE, max_tokens=48)


def test_max_tokens_and_length(pair):
    r = pair.generate(CODE, max_tokens=7)
    assert len(r.tokens) == 7 and r.finish_reason == "length"
    assert r.stats.n_generated == 7


def test_eos_ends_with_stop(pair):
    r = pair.chat([{"role": "user", "content": "Reply with just the word yes."}], max_tokens=50)
    assert r.finish_reason == "stop"
    assert len(r.tokens) < 50
    assert not any(pair.target.is_eog(t) for t in r.tokens)
    assert "yes" in r.text.lower()


@pytest.mark.parametrize("n_draft", [0, 2])
def test_stop_string_straddling_tokens(pair, reference, n_draft):
    """Stop strings made of the end of one token and the start of the next, at several places."""
    pieces = [pair.detokenize([t]) for t in reference.tokens]
    full = "".join(pieces)
    checked = 0
    for i in range(3, len(pieces) - 1, 5):
        if len(pieces[i]) < 2 or not pieces[i + 1].strip():
            continue
        stop = pieces[i][-2:] + pieces[i + 1][:2]
        expected = full[:full.find(stop)]
        r = pair.generate(CODE, max_tokens=48, stop=[stop], n_draft=n_draft)
        assert r.text == expected, stop
        assert r.finish_reason == "stop"
        assert stop not in r.text
        checked += 1
    assert checked >= 3


def test_stream_chunks_add_up_and_never_leak_past_stop(pair, reference):
    full = pair.detokenize(reference.tokens)
    stop = full[30:36]
    stream = pair.stream(CODE, max_tokens=48, stop=stop, n_draft=2)
    chunks = list(stream)
    text = "".join(c.text for c in chunks)
    assert text == full[:full.find(stop)] == stream.result.text
    assert stream.result.finish_reason == "stop"
    tokens = [t for c in chunks for t in c.tokens]
    assert tokens == stream.result.tokens == reference.tokens[:len(tokens)]
    assert any(flag for c in chunks for flag in c.from_draft), "no chunk came from the draft"
    assert stream.result.stats.n_generated == len(tokens)


def test_stream_utf8_never_splits_a_character(pair):
    # Fraktur letters and some emoji are split over two byte-level tokens in Qwen's vocabulary
    prompt = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 你好 🦩, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 你好 🦩, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 你好 🦩, 𝔘𝔫"
    stream = pair.stream(prompt, max_tokens=40)
    chunks = list(stream)
    assert all("\ufffd" not in c.text for c in chunks)
    text = "".join(c.text for c in chunks)
    assert any(ord(ch) > 0x2E80 for ch in text), text  # CJK or emoji present
    multi_byte_split = [c for c in chunks if c.tokens and not c.text]
    assert multi_byte_split, "no token ended inside a character, so the test proved nothing"
    assert text == pair.detokenize(stream.result.tokens)


def test_several_tokens_per_round_are_streamed(pair):
    stream = pair.stream(COPY, max_tokens=24, n_draft=2)  # a copy: the draft agrees on any CPU
    chunks = list(stream)
    assert stream.result.stats.tokens_per_round > 1.5
    assert len([c for c in chunks if c.tokens]) == len(stream.result.tokens)


def test_closing_a_stream_early_cancels_and_keeps_the_model_usable(pair, plain):
    stream = pair.stream(CODE, max_tokens=40)
    next(stream), next(stream)
    stream.close()
    assert stream.result.finish_reason == "cancelled"
    assert pair.generate(CODE, max_tokens=16).tokens == plain.generate(CODE, max_tokens=16).tokens


def test_chat_stream_is_chat_in_pieces(pair):
    """chat_stream: the chunks add up to chat()'s text and tokens, and the stream's result is its Result."""
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    whole = pair.chat(messages, max_tokens=20)
    stream = pair.chat_stream(messages, max_tokens=20)
    chunks = list(stream)
    assert len(chunks) > 1 and "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.tokens] == whole.tokens == stream.result.tokens
    assert stream.result.finish_reason == whole.finish_reason and stream.result.stats.n_prompt == whole.stats.n_prompt


def test_chat_template_is_applied(pair):
    tokens = pair.chat_tokens(CHAT)
    text = pair.detokenize(tokens)
    assert pair.target.chat_template() is not None
    assert pair.tokenize("<|im_start|>")[0] in tokens
    assert CHAT[0]["content"] in text
