"""Property-based: random prompts, settings and call sequences on one object.

Temperature 0 always equals target-only output; seeded sampling is reproducible; nothing but
the documented exceptions escapes. CI runs a few examples; SPECLLAMA_PROPERTY_EXAMPLES sets more.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WORDS = ["def", "return", "the", "lighthouse", "{", "}", '"name":', "1.", "2.", "and", "x", "=", "\n", "    ",
         "for", "in", "range(10):", "print(", ")", "keeper", "wrote", "é", "你好", "🦙"]

prompts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
n_drafts = st.sampled_from([0, 1, 2, 3, 8, "auto"])
actions = st.lists(st.tuples(st.sampled_from(["generate", "stream", "close_early", "sample"]), prompts, n_drafts,
                             st.integers(1, 12)), min_size=1, max_size=3)


@settings(max_examples=int(os.environ.get("SPECLLAMA_PROPERTY_EXAMPLES", "6")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(actions=actions)
def test_random_call_sequences(pair, plain, actions):
    for action, prompt, n_draft, max_tokens in actions:
        if action == "generate":
            got = pair.generate(prompt, max_tokens=max_tokens, n_draft=n_draft)
            assert got.tokens == plain.generate(prompt, max_tokens=max_tokens).tokens
        elif action == "stream":
            stream = pair.stream(prompt, max_tokens=max_tokens, n_draft=n_draft)
            text = "".join(c.text for c in stream)
            expected = plain.generate(prompt, max_tokens=max_tokens)
            assert stream.result.tokens == expected.tokens and text == expected.text
        elif action == "close_early":
            stream = pair.stream(prompt, max_tokens=max_tokens, n_draft=n_draft)
            first = next(stream, None)
            stream.close()
            # a stream closed after its first chunk: that chunk was plain decoding's start, its
            # slot is free and the models consistent, so the same call again gives plain output
            expected = plain.generate(prompt, max_tokens=max_tokens)
            assert first is not None and expected.tokens[:len(first.tokens)] == first.tokens
            assert pair.generate(prompt, max_tokens=max_tokens, n_draft=n_draft).tokens == expected.tokens
        else:
            a = pair.generate(prompt, max_tokens=max_tokens, n_draft=n_draft, temperature=0.9, seed=max_tokens)
            b = pair.generate(prompt, max_tokens=max_tokens, n_draft=n_draft, temperature=0.9, seed=max_tokens)
            assert a.tokens == b.tokens
