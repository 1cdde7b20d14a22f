"""Stop strings and UTF-8 streaming as pure functions."""

from __future__ import annotations

import pytest

from specllama.text import Detokenizer, StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    out.append(m.flush())
    return "".join(out), m.stopped, out


@pytest.mark.parametrize("pieces", [
    ["Hello wor", "ld", "\nEND", " more"],
    ["Hello world\n", "E", "N", "D more"],
    ["Hello world\nEND more"],
    ["Hello world\nE", "ND"],
])
def test_stop_across_pieces(pieces):
    text, stopped, _ = run(["\nEND"], pieces)
    assert (text, stopped) == ("Hello world", True)


def test_text_after_stop_never_leaks():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("OP and then") == ""
    assert m.feed("more") == "" and m.flush() == ""


def test_partial_match_that_does_not_complete_is_released():
    text, stopped, out = run(["</s>"], ["a </", "b> c"])
    assert (text, stopped) == ("a </b> c", False)
    assert out[0] == "a "  # "</" held back until it cannot be a stop string


def test_earliest_of_several_stops_wins():
    text, stopped, _ = run(["bb", "ab"], ["xxabb"])
    assert (text, stopped) == ("xx", True)


def test_no_stops_passes_through():
    assert run([], ["a", "b"])[0] == "ab"


def test_utf8_split_across_tokens_is_never_split_in_output():
    data = "né 你好 🎉".encode()
    d = Detokenizer()
    out = [d.feed(data[i:i + 1]) for i in range(len(data))]
    assert "".join(out) + d.flush() == "né 你好 🎉"
    assert all("\ufffd" not in piece for piece in out)


def test_invalid_utf8_becomes_replacement_at_flush():
    d = Detokenizer()
    assert d.feed(b"ok\xe4\xbd") == "ok"
    assert d.flush() == "\ufffd"
