"""llama-cpp-python's completion API on SpecLlama: a script for llama_cpp.Llama runs unchanged."""

from __future__ import annotations

import llama_cpp
import pytest

import specllama
from specllama.errors import InvalidParameterError
from specllama.runtime.decoder import DECODER

CHAT = [{"role": "user", "content": "Name three sorting algorithms."}]


def script(llm) -> dict:
    """A script body written for llama_cpp.Llama, not changed for specllama."""
    out = {}
    out["completion"] = llm.create_completion("def add(a, b):", max_tokens=16, temperature=0, stop=["\n\n"])
    out["call"] = llm("The capital of France is", max_tokens=8, temperature=0)
    out["chat"] = llm.create_chat_completion(CHAT, max_tokens=16, temperature=0)
    out["chunks"] = list(llm.create_completion("def add(a, b):", max_tokens=8, temperature=0, stream=True))
    out["chat_chunks"] = list(llm.create_chat_completion(CHAT, max_tokens=8, temperature=0, stream=True))
    return out


def keys(d):
    """The nested key structure of a response (values aside)."""
    if isinstance(d, dict):
        return {k: keys(v) for k, v in d.items()}
    if isinstance(d, list):
        return [keys(v) for v in d[:1]]
    return type(d).__name__ if d is not None else None


@pytest.fixture(scope="module")
def both(model_paths):
    # the same llama.cpp context settings on both sides (llama-cpp-python's defaults but n_ctx
    # and threads), so their greedy text can be compared token for token
    settings = dict(n_ctx=2048, n_threads=2)
    reference = llama_cpp.Llama(model_path=str(model_paths["target"]), verbose=False, **settings)
    try:
        # on specllama's decode thread: llama.cpp's OpenMP team of this (the main) thread would
        # live as long as the process and slow every later test's decodes (runtime/decoder.py)
        expected = DECODER.run(script, reference)
    finally:
        reference.close()
    with specllama.load(model_paths["target"], flash_attn=False, **settings) as llm:
        yield expected, script(llm)


@pytest.mark.parametrize("name", ["completion", "call", "chat"])
def test_same_shape_and_text(both, name):
    expected, got = both
    e, g = expected[name], got[name]
    assert keys(g)["choices"] == keys(e)["choices"] and set(g) == set(e) and keys(g)["usage"] == keys(e)["usage"]
    assert g["object"] == e["object"] and g["id"].split("-")[0] == e["id"].split("-")[0]
    if name == "chat":
        assert g["choices"][0]["message"] == e["choices"][0]["message"]
    else:
        assert g["choices"][0]["text"] == e["choices"][0]["text"]
    assert g["choices"][0]["finish_reason"] == e["choices"][0]["finish_reason"]
    assert g["usage"] == e["usage"]


@pytest.mark.parametrize("name, field", [("chunks", "text"), ("chat_chunks", "delta")])
def test_same_chunk_sequence(both, name, field):
    expected, got = both
    e, g = expected[name], got[name]
    assert [keys(c) for c in g[:1]] == [keys(c) for c in e[:1]]
    assert keys(g[-1]) == keys(e[-1]) and g[-1]["choices"][0]["finish_reason"] == e[-1]["choices"][0]["finish_reason"]
    if field == "text":
        assert "".join(c["choices"][0]["text"] for c in g) == "".join(c["choices"][0]["text"] for c in e)
    else:
        assert g[0]["choices"][0]["delta"] == {"role": "assistant"} == e[0]["choices"][0]["delta"]
        assert ("".join(c["choices"][0]["delta"].get("content", "") for c in g)
                == "".join(c["choices"][0]["delta"].get("content", "") for c in e))


@pytest.mark.parametrize("argument, value", [("grammar", object()), ("logit_bias", {"x": 2.0}), ("repeat_penalty", 0),
                                              ("mirostat_mode", 2), ("logprobs", 50), ("typical_p", 0.5),
                                              ("echo", True), ("presence_penalty", float("inf"))])
def test_arguments_that_cannot_be_honoured_are_named(pair, argument, value):
    with pytest.raises(InvalidParameterError, match=argument):
        pair.create_completion("def f():", max_tokens=4, **{argument: value})
    # neutral values change nothing and pass
    assert pair.create_completion("def f():", max_tokens=4, temperature=0, repeat_penalty=1.0,
                                  mirostat_tau=5.0)["choices"][0]["text"]


def test_speculative_create_completion_equals_target_alone(pair, plain):
    """With a draft model, the same greedy text as the target alone."""
    got = pair.create_chat_completion(CHAT, max_tokens=24, temperature=0, n_draft=3)
    assert got["choices"][0]["message"]["content"] == plain.chat(CHAT, max_tokens=24).text
