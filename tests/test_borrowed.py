"""load() accepts llama_cpp.Llama objects the caller built (their Metal/CUDA settings kept)."""

from __future__ import annotations

import llama_cpp

import specllama

from prompts import CODE


def test_borrowed_llama_objects_generate_exactly(model_paths):
    target = llama_cpp.Llama(model_path=str(model_paths["target"]), n_ctx=2048, n_threads=2, verbose=False)
    draft = llama_cpp.Llama(model_path=str(model_paths["draft"]), n_ctx=2048, n_threads=2, verbose=False)
    try:
        with specllama.load(target) as alone:  # the baseline, with the caller's own settings
            expected = alone.generate(CODE, max_tokens=24).tokens
        with specllama.load(target, draft, n_draft=2) as llm:
            got = llm.generate(CODE, max_tokens=24)
            assert got.tokens == expected
            # the fidelity level measured the borrowed context's own batch differences
            short = llm.batch_diffs.groups[0]
            assert got.stats.n_draft_max == min(2, short.largest_batch(llm.level.bound) - 1)
            # we did not see them load, so no per-model figure is made up; the process total is real
            assert (got.stats.n_bytes_target, got.stats.n_bytes_draft) == (0, 0)
            assert got.stats.n_bytes_resident > 0
        with specllama.load(target, draft, n_draft=2, exact="off") as llm:
            assert llm.generate(CODE, max_tokens=24).stats.n_drafted > 0  # the draft really runs
        # the caller still owns them: closing the SpecLlama freed nothing of theirs
        assert target.tokenize(b"hello") and draft.n_ctx() == 2048
    finally:
        target.close()
        draft.close()
