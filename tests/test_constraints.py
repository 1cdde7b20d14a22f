"""Constraints in the verify loop: the row transforms on synthetic rows and against llama.cpp's own
samplers, then greedy identity with plain one-token decoding under the same constraint, sampling
against the constrained target distribution, and interruptions, on the real models."""

from __future__ import annotations

import contextlib
import ctypes

import llama_cpp
import numpy as np
import pytest

import specllama
from specllama import ConstraintError, InvalidParameterError
from specllama.decoding.constraints import (Constraint, Grammar, Lark, Penalties, check_logit_bias,
                                            grammar_source)
from specllama.decoding.sampling import SamplingSettings, distribution
from conftest import own_target
from test_verify import chi2_critical, chi2_stat

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Extract as JSON with name, age and languages: Maria Lopez is 34 "
                                       "and writes Rust, Go and Python every day."}]
GBNF = r'''root ::= "def " name "(" name ("," " " name)* "):" "\n" ("    " [^\n]+ "\n"){1,3}
name ::= [a-z_]+'''
CODE = "Write a Python function that returns the larger of two numbers."


# --- the transforms, pure -----------------------------------------------------------------------

def _llama_cpp_penalties(row: np.ndarray, history: list[int], p: Penalties) -> np.ndarray:
    """The row after llama.cpp's own penalties sampler has accepted history."""
    n = row.shape[0]
    sampler = llama_cpp.llama_sampler_init_penalties(n, p.last_n, p.repeat, p.frequency, p.presence)
    try:
        for token in history:
            llama_cpp.llama_sampler_accept(sampler, token)
        data = (llama_cpp.llama_token_data * n)()
        for i in range(n):
            data[i].id, data[i].logit, data[i].p = i, float(row[i]), 0.0
        array = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        return np.array([data[i].logit for i in range(n)], dtype=np.float32)
    finally:
        llama_cpp.llama_sampler_free(sampler)


@pytest.mark.parametrize("penalties", [Penalties(repeat=1.3), Penalties(frequency=0.7, presence=0.4),
                                       Penalties(repeat=1.1, frequency=0.2, presence=0.3, last_n=5)])
def test_penalties_are_llama_cpps(penalties):
    rng = np.random.default_rng(0)
    row = rng.normal(0, 3, 300).astype(np.float32)
    history = rng.integers(0, 40, 30).tolist()
    ours = row.copy()
    penalties.apply(ours, history)
    expected = _llama_cpp_penalties(row, history, penalties)
    assert np.array_equal(ours, expected)
    assert not np.array_equal(ours, row)


def test_logit_bias_keys_and_values_are_checked():
    assert check_logit_bias({"12": -100, 7: 2.5}, 100) == {12: -100.0, 7: 2.5}
    for bad in ({"x": 1}, {100: 1}, {-1: 1}, {3: "a"}, {3: float("nan")}, [1, 2]):
        with pytest.raises(InvalidParameterError) as e:
            check_logit_bias(bad, 100)
        assert e.value.name == "logit_bias"


def test_bad_grammars_and_schemas_name_the_field():
    with pytest.raises(InvalidParameterError) as e:
        grammar_source(grammar="root ::= (")
    assert e.value.name == "grammar"
    with pytest.raises(InvalidParameterError) as e:
        grammar_source(json_schema="{not json")
    assert e.value.name == "json_schema"
    with pytest.raises(InvalidParameterError):
        grammar_source(grammar='root ::= "a"', json_schema={"type": "object"})


def test_a_grammar_the_matcher_cannot_build_names_the_field(plain):
    """Rules that parse but name nothing (checked where the matcher is built, in one compile)."""
    source = grammar_source(grammar=Lark("start: missing_rule"))
    with pytest.raises(InvalidParameterError, match="a grammar llguidance accepts") as e:
        Grammar(plain.target.grammar_tokenizer(), source, "response_format")
    assert e.value.name == "response_format"
    assert Grammar(plain.target.grammar_tokenizer(), grammar_source(grammar=Lark('start: "a"'))).allowed().any()


def test_constraint_state_follows_accept_and_rollback(plain):
    """A rollback restores the mask, the penalties' window and the forced tokens; an end-of-
    generation token that the grammar does not consume rolls back without touching it."""
    runtime = plain.target
    grammar = Grammar(runtime.grammar_tokenizer(), grammar_source(json_schema={
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}))
    c = Constraint(penalties=Penalties(repeat=1.5), grammar=grammar)
    row = np.random.default_rng(1).normal(0, 2, runtime.n_vocab).astype(np.float32)
    ids = runtime.tokenize('{"a": 3}', add_special=False)
    assert c.forced(8) == ids[:len(c.forced(8))] and c.forced(8)  # '{"a":' is forced
    for t in ids[:-2]:
        c.accept(t)
    before = c.apply(row)
    c.accept(ids[-2])
    c.accept(ids[-1])
    after_close = np.isfinite(c.apply(row))
    assert set(np.flatnonzero(after_close)) <= set(runtime.grammar_tokenizer().eos_tokens)
    c.accept(runtime.eos)  # ends the text; the matcher does not consume it
    c.rollback(3)
    assert np.array_equal(c.apply(row), before)
    with pytest.raises(ConstraintError):
        c.accept(runtime.tokenize("x", add_special=False)[0])


# --- the reference: plain decoding, one token at a time, the constraint applied to each row -----

def plain_constrained(llm, tokens: list[int], n_max: int, constraint: Constraint) -> list[int]:
    """Greedy decoding on the target alone: prefill, then one token per decode, each chosen as
    argmax of its row after the constraint."""
    with own_target(llm) as target:
        target.truncate(0)
        target.sync(tokens)  # a fresh prefill, as every plain generation's
        out: list[int] = []
        while len(out) < n_max:
            token = int(np.argmax(constraint.apply(target.logits(0))))
            if target.is_eog(token):
                break
            constraint.accept(token)
            out.append(token)
            target.decode([token])
        target.truncate(0)
    return out


def _grammar(llm, **kw) -> Grammar:
    source = grammar_source(**kw)
    assert source is not None
    return Grammar(llm.target.grammar_tokenizer(), source)


CASES = {
    "json_schema": (EXTRACT, dict(json_schema=SCHEMA), lambda llm: dict(grammar=_grammar(llm, json_schema=SCHEMA))),
    "gbnf": (CODE, dict(grammar=GBNF), lambda llm: dict(grammar=_grammar(llm, grammar=GBNF))),
    "logit_bias": (CODE, dict(logit_bias={"750": -100.0, "1140": 4.0}),
                   lambda llm: dict(logit_bias={750: -100.0, 1140: 4.0})),
    "penalties": (CODE, dict(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
                  lambda llm: dict(penalties=Penalties(1.3, 0.4, 0.3))),
}
N_TOKENS = 48


@pytest.fixture(scope="module")
def references(plain):
    out = {}
    for name, (prompt, _, build) in CASES.items():
        tokens = plain.chat_tokens([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        out[name] = (tokens, plain_constrained(plain, tokens, N_TOKENS, Constraint(**build(plain))))
    return out


def test_references_differ_from_unconstrained_output(plain, references):
    """Each constraint changes the output, or the identity below would prove nothing."""
    for name, (tokens, expected) in references.items():
        assert _differs(plain, tokens, expected), name


def _differs(llm, tokens, expected) -> bool:
    """Whether llm's unconstrained greedy answer to tokens differs from expected, decoding only
    until it does (the whole answers cost 11 s of the suite)."""
    free: list[int] = []
    with contextlib.closing(llm.stream(tokens, max_tokens=N_TOKENS)) as stream:
        for chunk in stream:
            free += chunk.tokens
            if free != expected[:len(free)]:
                return True
    return free != expected


@pytest.mark.parametrize("n_draft", [2, 4, "auto"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_constrained_speculative_greedy_equals_constrained_plain(pair, references, name, n_draft):
    tokens, expected = references[name]
    got = pair.generate(tokens, max_tokens=N_TOKENS, n_draft=n_draft, exact="bitwise", **CASES[name][1])
    assert got.tokens == expected
    if name == "json_schema":  # keys and punctuation
        assert got.stats.n_grammar_rounds > 0 and got.stats.n_forced_accepted > 0, got.stats.summary()
    if n_draft != "auto":  # auto may find that drafting does not pay on this machine
        assert got.stats.n_drafted > 0, got.stats.summary()


def test_constrained_output_is_valid_json(pair):
    import json

    r = pair.generate(pair.chat_tokens(EXTRACT), max_tokens=96, json_schema=SCHEMA)
    assert r.finish_reason == "stop"
    value = json.loads(r.text)
    assert set(value) == {"name", "age", "languages"} and isinstance(value["age"], int)


def test_an_interrupted_constrained_stream_is_followed_by_an_identical_run(pair, references):
    tokens, expected = references["json_schema"]
    stream = pair.stream(tokens, max_tokens=N_TOKENS, n_draft=4, exact="bitwise", json_schema=SCHEMA)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    assert stream.result.finish_reason == "cancelled"
    again = pair.generate(tokens, max_tokens=N_TOKENS, n_draft=4, exact="bitwise", json_schema=SCHEMA)
    assert again.tokens == expected


def check_grammar_sampling(pair, plain, prompt, n_seeds, temperature):
    """The second token under a small grammar, over many seeds, against p: the target's row
    after the grammar has consumed the first token, through the same sampling transform."""
    fruits = ["apple", "banana", "cherry", "grape", "mango", "pear", "plum", "peach"]
    grammar = 'root ::= ": " (' + " | ".join(f'"{f}"' for f in fruits) + ")"
    settings = dict(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
    runs = [pair.generate(prompt, max_tokens=2, seed=seed, n_draft=2, grammar=grammar, **settings)
            for seed in range(n_seeds)]
    first = [r.tokens[0] for r in runs]
    mode = max(set(first), key=first.count)
    second = [r.tokens[1] for r in runs if r.tokens[0] == mode and len(r.tokens) > 1]
    constraint = Constraint(grammar=_grammar(plain, grammar=grammar))
    constraint.accept(mode)
    with own_target(plain) as target:
        target.truncate(0)
        target.sync(prompt)
        target.decode([mode])
        p = distribution(constraint.apply(target.logits(0)), SamplingSettings(**settings))
        target.truncate(0)
    assert len(p.ids) >= 3, "the grammar leaves too few choices to test"
    outside = set(second) - set(p.ids.tolist())
    assert not outside, f"tokens the grammar forbids were produced: {outside}"
    observed = np.array([second.count(int(t)) for t in p.ids])
    stat, df = chi2_stat(observed, p.probs)
    assert stat < chi2_critical(df), (stat, df, observed, p.probs)
    assert len(second) > n_seeds // 2
    assert sum(r.stats.n_drafted - r.stats.n_accepted for r in runs) > 20, "no rejections were exercised"


def test_sampling_under_a_grammar_has_the_constrained_target_distribution(tiny_paths):
    """On the tiny hybrid target with the tiny attention model as its draft (scripts/tiny_models.py):
    the property is the verifier's and the grammar's, not the real pair's. Random weights give
    peaked rows, so a temperature of 3 spreads p over the fruits (about 6 of them) and the
    draft's q away from it (about a quarter of drafts rejected); 400 seeds take a third of the
    real pair's 200."""
    settings = dict(n_ctx=256, n_threads=2)
    with specllama.load(tiny_paths["hybrid-target"], tiny_paths["attention-draft"], **settings) as pair, \
            specllama.load(tiny_paths["hybrid-target"], exact="bitwise", **settings) as plain:
        check_grammar_sampling(pair, plain, plain.tokenize("Q: Name a random fruit.\nA"), 400, 3.0)


@pytest.mark.slow  # the real pair: 44 s of the suite's time; the tiny pair above tests the same
def test_sampling_under_a_grammar_on_the_real_pair(pair, plain):
    check_grammar_sampling(pair, plain, plain.tokenize("Q: Name a random fruit.\nA"), 200, 1.5)


def test_logprobs_come_from_the_target_rows(pair, plain):
    tokens = pair.chat_tokens([{"role": "user", "content": CODE}])
    r = pair.stream(tokens, max_tokens=12, n_draft=4, logprobs=3)
    chunks = list(r)
    got = [lp for c in chunks for lp in (c.logprobs or [])]
    emitted = [t for c in chunks for t in c.tokens]
    assert len(got) == len(emitted) == 12
    with own_target(plain) as target:
        target.truncate(0)
        target.sync(tokens)
        for token, (logprob, top) in zip(emitted, got):
            row = target.logits(0).astype(np.float64)
            logp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert len(top) == 3 and top[0][0] == int(np.argmax(row)) == token
            assert abs(logprob - logp[token]) < 0.05  # batch rows differ from single-token ones by rounding
            target.decode([token])
        target.truncate(0)
