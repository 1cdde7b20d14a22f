"""Bad input: a typed error with a clear message, and the object keeps working afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import specllama
from specllama import (
    EmptyPromptError,
    IncompatibleDraftError,
    InvalidModelFileError,
    InvalidParameterError,
    ModelNotFoundError,
    PromptTooLongError,
)
from specllama.models.compat import VocabInfo, check_compatible
from specllama.models.compat import vocab_info
from specllama.runtime import ModelSettings, Runtime

from conftest import SETTINGS
from prompts import CODE, LONG_CODE


@pytest.fixture(scope="module")
def golden(plain):
    return plain.generate(CODE, max_tokens=12).tokens


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model file not found: .*nope.gguf"):
        specllama.load(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>not a model</html>" * 100)
    with pytest.raises(InvalidModelFileError, match="not a valid GGUF model.*magic"):
        specllama.load(path)


def test_directory(tmp_path):
    with pytest.raises(InvalidModelFileError, match="is not a file"):
        specllama.load(tmp_path)


@pytest.mark.parametrize("fraction", [0.001, 0.5, 0.999])
def test_truncated_gguf(tmp_path, model_paths, fraction):
    src = model_paths["smollm2"]
    path = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(int(src.stat().st_size * fraction)))
    with pytest.raises(InvalidModelFileError, match="truncated|past the end"):
        specllama.load(path)


def test_incompatible_draft_via_load(model_paths):
    with pytest.raises(IncompatibleDraftError, match=r"token \d+ is .* in the target but .* in the draft|differs"):
        specllama.load(model_paths["draft"], model_paths["smollm2"], **SETTINGS)


@pytest.mark.parametrize("name", ["gemma", "smollm2"])
def test_incompatible_draft_names_the_difference(pair, model_paths, name):
    with Runtime.load(model_paths[name], ModelSettings(**SETTINGS)) as other:
        with pytest.raises(IncompatibleDraftError) as info:
            specllama.SpecLlama(pair.target, other)
    message = str(info.value)
    assert other.name in message and pair.target.name in message
    assert "same model family" in message


# llama.cpp's order of checks (common/speculative.cpp): vocabulary type, BOS/EOS flags and ids,
# size, then each token's text from id 5
FIELDS = (("vocab_type", "vocabulary type"), ("add_bos", "add-BOS flag"), ("add_eos", "add-EOS flag"),
          ("bos", "BOS token"), ("eos", "EOS token"))


def test_first_differing_token_is_named(pair, model_paths):
    """SmolLM2 beside Qwen: the first difference in llama.cpp's order is named with both values."""
    with Runtime.load(model_paths["smollm2"], ModelSettings(**SETTINGS)) as other:
        with pytest.raises(IncompatibleDraftError) as info:
            specllama.SpecLlama(pair.target, other)
        target, draft = vocab_info(pair.target), vocab_info(other)
        first = next((f"{label} differs (target {getattr(target, a)}, draft {getattr(draft, a)})"
                      for a, label in FIELDS if getattr(target, a) != getattr(draft, a)), None)
        if first is None:
            token = next(t for t in range(5, min(target.n_vocab, draft.n_vocab))
                         if target.token_text(t) != draft.token_text(t))
            first = f"token {token} is "
    assert first in str(info.value), (first, str(info.value))


def _vocab(texts: dict[int, bytes], n_vocab: int = 50, bos: int = 1, name: str = "m") -> VocabInfo:
    return VocabInfo(name, 2, n_vocab, bos, 2, False, False, lambda t: texts.get(t, b"t%d" % t))


def test_the_vocabulary_rules_on_synthetic_vocabularies():
    check_compatible(_vocab({}), _vocab({3: b"other"}, n_vocab=50 + 128))  # ids under 5 and 128 more tokens: fine
    with pytest.raises(IncompatibleDraftError, match=r"token 7 is 'seven' in the target but 't7' in the draft"):
        check_compatible(_vocab({7: b"seven", 9: b"nine"}), _vocab({}))  # the first of two differences
    with pytest.raises(IncompatibleDraftError, match=r"BOS token differs \(target 1, draft 0\)"):
        check_compatible(_vocab({7: b"seven"}), _vocab({}, bos=0))  # ids before token texts
    with pytest.raises(IncompatibleDraftError, match="by more than 128"):
        check_compatible(_vocab({}), _vocab({}, n_vocab=50 + 129))


def test_same_model_as_its_own_draft_is_compatible(pair):
    target, draft = vocab_info(pair.target), vocab_info(pair.draft)
    check_compatible(target, draft)  # the 1.5B target and its 0.5B draft share a tokenizer: no error
    assert target.n_vocab == draft.n_vocab and target.token_text(1000) == draft.token_text(1000)
    changed = VocabInfo(draft.name, draft.vocab_type, draft.n_vocab, draft.bos, draft.eos, draft.add_bos,
                        draft.add_eos, lambda t: b"?" if t == 1000 else draft.token_text(t))
    with pytest.raises(IncompatibleDraftError, match="token 1000 is"):
        check_compatible(target, changed)  # the same check fails where one token's text differs


BAD_CALLS = [
    (dict(prompt=""), EmptyPromptError, "empty"),
    (dict(prompt=[]), EmptyPromptError, "empty"),
    (dict(prompt=[10**9]), InvalidParameterError, "prompt="),
    (dict(prompt=None), InvalidParameterError, "prompt="),
    (dict(prompt="x " * 3000), PromptTooLongError, "tokens but the context holds 2048"),
    (dict(n_draft=-1), InvalidParameterError, r"n_draft=-1 .* 0\.\.32"),
    (dict(n_draft=100), InvalidParameterError, "n_draft=100"),
    (dict(temperature=-1.0), InvalidParameterError, "temperature=-1.0"),
    (dict(top_p=0.0), InvalidParameterError, r"top_p=0\.0 .* \(0, 1\]"),
    (dict(top_p=1.5), InvalidParameterError, "top_p=1.5"),
    (dict(max_tokens=0), InvalidParameterError, "max_tokens=0 .* >= 1, or None"),
    (dict(max_tokens=2.5), InvalidParameterError, "max_tokens=2.5"),
    (dict(seed=-3), InvalidParameterError, "seed=-3"),
    (dict(stop=[""]), InvalidParameterError, "stop="),
    (dict(top_k=-2), InvalidParameterError, "top_k=-2"),
    (dict(min_p=2.0), InvalidParameterError, "min_p=2.0"),
    (dict(exact="fuzzy"), InvalidParameterError, "exact='fuzzy' is invalid.*bitwise.*rounding"),
    (dict(exact=-0.5), InvalidParameterError, "exact=-0.5"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_CALLS, ids=[str(k) for k, _, _ in BAD_CALLS])
def test_bad_parameters_raise_then_the_object_still_works(pair, golden, kwargs, error, message):
    kwargs = {"max_tokens": 12, **kwargs}
    prompt = kwargs.pop("prompt", CODE)
    with pytest.raises(error, match=message):
        pair.generate(prompt, **kwargs)
    with pytest.raises(error, match=message):  # streams check eagerly, before any iteration
        pair.stream(prompt, **kwargs)
    assert pair.generate(CODE, max_tokens=12).tokens == golden


def test_value_errors_are_value_errors(pair):
    with pytest.raises(ValueError):
        pair.generate(CODE, temperature=-1)
    with pytest.raises(ValueError):
        pair.generate("")


def test_unknown_setting_is_a_type_error(model_paths):
    with pytest.raises(TypeError, match="unknown setting 'n_gpu'"):
        specllama.load(model_paths["target"], n_gpu=3)


def test_invalid_model_settings(model_paths):
    with pytest.raises(InvalidParameterError, match="n_ctx=4 "):
        specllama.load(model_paths["target"], n_ctx=4)
    with pytest.raises(InvalidParameterError, match="type_k='q9'"):
        specllama.load(model_paths["target"], type_k="q9")


def test_context_fills_up_with_length(tiny_paths):
    # the tiny attention model as target and draft: the rule is the engine's (the real pair's
    # drafted and tree rounds at the context's end are the next test)
    tiny = tiny_paths["attention-draft"]
    with specllama.load(tiny, tiny, n_ctx=64, n_threads=2) as llm:
        prompt = llm.tokenize(CODE)
        r = llm.generate(prompt, max_tokens=500)
        assert r.finish_reason == "length"
        n_ctx = llm.target.n_ctx  # llama.cpp rounds n_ctx up to its padding
        assert n_ctx < 512
        assert len(prompt) + len(r.tokens) == n_ctx + 1
        # max_tokens=None (llama-cpp-python's spelling): as many as the context holds, the same tokens
        assert llm.generate(prompt, max_tokens=None).tokens == r.tokens
        with pytest.raises(PromptTooLongError):
            llm.generate(prompt * 100)
        exact_fit = (prompt * 100)[:n_ctx]
        assert len(llm.generate(exact_fit, max_tokens=5).tokens) == 1


def test_drafted_tree_rounds_at_the_end_of_the_context_finish_with_length(model_paths):
    """The real pair drafting 4 tokens a round with 2 candidates a position (exact="off": no verify
    limit keeps it plain) up to the last cell of both contexts: the answer ends with "length"
    at exactly the cells there are, never a ContextFullError from a draft or a verify pass, and
    the object goes on working."""
    with specllama.load(model_paths["target"], model_paths["draft"], n_ctx=64, n_threads=2, exact="off", n_draft=4,
                        tree=2) as llm:
        prompt = llm.tokenize(LONG_CODE)[:llm.target.n_ctx - 48]  # llama.cpp's least context is 256 cells
        r = llm.generate(prompt, max_tokens=None)
        assert r.finish_reason == "length" and len(prompt) + len(r.tokens) == llm.target.n_ctx + 1
        assert r.stats.n_drafted > 0 and r.stats.n_tree_rounds > 0, r.stats.as_dict()
        again = llm.generate(prompt, max_tokens=6)
        assert again.finish_reason == "length" and len(again.tokens) == 6


@pytest.mark.children
def test_run_n_minus_one_generates_until_the_context_is_full(model_paths):
    """llama.cpp's -n -1; the default of 256 would stop first at this context (512 cells)."""
    out = subprocess.run([sys.executable, "-m", "specllama", "run", str(model_paths["smollm2"]), "1, 2, 3, 4,",
                          "--raw", "-n", "-1", "-c", "512", "--draft", "none", "--threads",
                          str(SETTINGS["n_threads"]), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["settings"]["max_tokens"] is None
    assert result["finish_reason"] == "length"  # counting on: the context filled, past 256 tokens
    assert result["stats"]["n_prompt"] + len(result["tokens"]) == result["settings"]["n_ctx"] + 1


def test_a_context_too_small_to_probe_decodes_plainly(model_paths, plain, home):
    """The fidelity probe needs room for its rows; without it, rounds verify one token. In an
    empty calibration folder: limits another test's load measured in the session's folder are
    this target's too, and let it draft (bitwise, as CI once saw: 4 drafted, the same tokens)."""
    with specllama.load(model_paths["target"], model_paths["draft"], n_ctx=16, n_threads=2) as llm:
        prompt = llm.tokenize(CODE)[:6]
        r = llm.generate(prompt, max_tokens=8, exact="bitwise")
        assert r.tokens == plain.generate(prompt, max_tokens=8).tokens
        assert r.stats.n_drafted == 0


def test_busy_when_this_threads_open_streams_hold_every_slot(model_paths, golden):
    """A generation beside an open stream decodes in a slot of its own; once this thread's own
    streams hold all n_parallel slots, one more is a BusyError (waiting would never end)."""
    with specllama.load(model_paths["target"], model_paths["draft"], n_parallel=2, **SETTINGS) as llm:
        streams = [llm.stream(CODE, max_tokens=8) for _ in range(2)]
        for stream in streams:
            next(stream)
        with pytest.raises(specllama.BusyError, match="all its 2 slots"):
            llm.generate(CODE, max_tokens=2)
        streams[0].close()
        assert llm.generate(CODE, max_tokens=12, exact="bitwise").tokens == golden
        streams[1].close()


@pytest.mark.parametrize("prompt", ["   \n\t ", "<|im_end|>", "<|im_start|><|im_end|>"])
def test_odd_prompts_have_defined_behaviour(pair, plain, prompt):
    got = pair.generate(prompt, max_tokens=6)
    assert got.tokens == plain.generate(prompt, max_tokens=6).tokens


def test_undecodable_text_is_a_clear_error(pair, golden):
    text = b"caf\xe9 \xff\xfe".decode("utf-8", errors="surrogateescape")
    with pytest.raises(InvalidParameterError, match="unpaired surrogate"):
        pair.generate(text, max_tokens=4)
    assert pair.generate(CODE, max_tokens=12).tokens == golden


def test_100kb_prompt_is_too_long_not_a_crash(pair, golden):
    with pytest.raises(PromptTooLongError, match="context holds 2048"):
        pair.generate("word " * 20_000, max_tokens=4)
    assert pair.generate(CODE, max_tokens=12).tokens == golden


def test_a_closed_object_raises_instead_of_reading_freed_memory(tiny_paths):
    llm = specllama.load(tiny_paths["attention-draft"], n_ctx=256, n_threads=2)
    llm.close()
    for use in (lambda: llm.tokenize("hi"), lambda: llm.detokenize([1, 2]), lambda: llm.generate("hi"),
                lambda: list(llm.stream("hi")), lambda: llm.generate([1, 2, 3]),
                lambda: llm.create_completion("hi", max_tokens=2)):
        with pytest.raises(specllama.ClosedError, match="load"):
            use()
