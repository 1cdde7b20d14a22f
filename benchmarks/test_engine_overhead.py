"""The engine's own time per drafted token and per verify pass, against a raw ctypes loop.

    .venv/bin/python -m pytest benchmarks/test_engine_overhead.py -s

Two stand-ins for fast hardware, 2 threads, 256 greedy tokens, where a token costs about what a
GPU's does, so whatever the engine spends outside llama.cpp shows:

- "tiny": the 2-layer attention model of scripts/tiny_models.py (Qwen's real 151,936-token
  vocabulary, random weights) as target and a perturbed copy of it as draft; its output head
  makes each row of a pass cost about one token, as on a CPU.
- "gpu-like": 160 narrow layers on SmolLM2's 49,152-token vocabulary as target and its first 32
  as draft: most of a pass is its layers' dispatch, whatever its rows, and a draft step costs
  about a fifth of a target step, as on a GPU. The closest a 2-core CPU gets: a verify of 8
  rows still costs 2.7x one row here (on a GPU about one).
 The minimum of N_REPEATS runs each (the raw loops in a process
of their own, specllama's alternating in this one):

- raw plain: llama_decode one token, argmax of its row, repeat (ctypes, no specllama);
- raw chain: the same llama.cpp calls specllama's chain rounds make (the draft's k steps, each
  a one-token decode and an argmax; one verify pass of k + 1 rows, an argmax per row; both
  caches cut back to what was accepted), with its own acceptance;
- specllama plain (n_draft=0), specllama chains (n_draft=k, tree=1, exact="off") and specllama
  at its defaults with n_draft=k (the rounding level, whose near-ties are judged on every
  accepted row, and trees), and chains sampled at temperature 1 (each draft step a distribution
  and a draw, each verify row a distribution), every llama_decode it makes timed, so the
  engine's own time is the rest: per drafted token (the draft phase's) and per verify pass (the
  rest of the round).

The speedup the llama.cpp time allows is raw plain's rate against raw chain's at specllama's
acceptance (tokens a round), which the engine reaches when its own time is zero.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

import specllama
from specllama.runtime import decoder

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fetch_models  # noqa: E402
import tiny_models  # noqa: E402

N_TOKENS = int(os.environ.get("SPECLLAMA_BENCH_TOKENS", "256"))
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
N_REPEATS = int(os.environ.get("SPECLLAMA_BENCH_REPEATS", "3"))
K = 4
PERTURB = 0.05  # the draft's noise: it agrees on most tokens, as a same-family draft does
PROMPT = list(range(1000, 1064))


# stand-in -> (the GGUF whose tokenizer it takes, the target's and the draft's writer arguments)
STAND_INS = {
    "tiny": ("draft", dict(), dict(perturb=PERTURB)),
    "gpu-like": ("smollm2", dict(n_layer=160, residual=0.015), dict(n_layer=32, residual=0.015)),
}


def stand_in_pair(kind: str) -> tuple[Path, Path]:
    tokenizer, *kwargs = STAND_INS[kind]
    version = hashlib.sha1(Path(tiny_models.__file__).read_bytes() + repr(STAND_INS[kind]).encode()).hexdigest()[:10]
    out = Path(tempfile.gettempdir()) / f"specllama-overhead-{kind}-{version}"
    out.mkdir(exist_ok=True)
    fields = None
    paths = []
    for name, args in zip(("target", "draft"), kwargs):
        path = out / f"{kind}-{name}.gguf"
        if not path.exists():
            fields = fields or tiny_models.tokenizer_fields(fetch_models.path_of(tokenizer))
            tiny_models.write_attention(fields, path.with_suffix(".partial"), **args)
            path.with_suffix(".partial").rename(path)
        paths.append(path)
    return paths[0], paths[1]


class Raw:
    """A model, a context and a batch through llama_cpp's C API alone."""

    def __init__(self, path: Path):
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 1024, 512, 512
        cparams.n_threads = cparams.n_threads_batch = N_THREADS
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_past = 0

    def decode(self, tokens: list[int], all_rows: bool = False) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, self.n_past + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_rows or i == len(tokens) - 1
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        self.n_past += len(tokens)

    def argmax(self, row: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(self.n_vocab,))))

    def cut(self, n_keep: int) -> None:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), 0, n_keep, -1)
        self.n_past = n_keep

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def raw_plain(target: Raw) -> float:
    """Seconds per generated token."""
    target.cut(0)
    target.decode(PROMPT)
    token, t0 = target.argmax(-1), time.perf_counter()
    for _ in range(N_TOKENS - 1):
        target.decode([token])
        token = target.argmax(-1)
    return (time.perf_counter() - t0) / (N_TOKENS - 1)


def raw_chain(target: Raw, draft: Raw) -> tuple[float, float]:
    """(seconds per generated token, tokens a round) of greedy chains of K drafts."""
    for model in (target, draft):
        model.cut(0)
        model.decode(PROMPT)
    tokens, n_rounds = [*PROMPT, target.argmax(-1)], 0  # the draft holds the prompt
    t0 = time.perf_counter()
    while len(tokens) - len(PROMPT) < N_TOKENS:
        n_past = len(tokens) - 1
        draft.decode(tokens[draft.n_past:])  # what it lacks: the newest token, after a full accept two
        drafts = [draft.argmax(-1)]
        for _ in range(K - 1):
            draft.decode(drafts[-1:])
            drafts.append(draft.argmax(-1))
        target.decode([tokens[-1], *drafts], all_rows=True)
        n_ok = 0
        while n_ok < K and target.argmax(n_ok) == drafts[n_ok]:
            n_ok += 1
        tokens += [*drafts[:n_ok], target.argmax(n_ok)]
        target.cut(n_past + 1 + n_ok)
        draft.cut(n_past + 1 + min(n_ok, K - 1))  # it holds the newest and its first K - 1 drafts
        n_rounds += 1
    n_new = len(tokens) - len(PROMPT) - 1
    return (time.perf_counter() - t0) / n_new, n_new / n_rounds


def _address(pointer) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def spec_run(llm, **options) -> dict:
    """One generation with every llama_decode timed, by the context it decoded in."""
    spent = {"draft": 0.0, "target": 0.0}
    which = {_address(llm.draft._ctx.ptr): "draft"} if llm.draft is not None else {}
    real = decoder._decode

    def timed(ctx, batch):
        t0 = time.perf_counter()
        try:
            return real(ctx, batch)
        finally:
            spent[which.get(_address(ctx), "target")] += time.perf_counter() - t0

    decoder._decode = timed
    try:
        r = llm.generate(PROMPT, max_tokens=N_TOKENS, **options)
    finally:
        decoder._decode = real
    s = r.stats
    n_new = s.n_generated - 1
    return {"per_token": (s.t_decode + s.t_draft_prefill) / n_new, "rounds": s.n_rounds, "drafted": s.n_drafted,
            "tokens_per_round": s.tokens_per_round, "t_draft": s.t_draft, "t_verify": s.t_verify,
            "t_decode": s.t_decode, "llama_draft": spent["draft"], "llama_target": spent["target"], "tokens": r.tokens}


def raw_pass(model: Raw, n_rows: int, n_repeats: int = 60) -> float:
    """The median seconds of one pass of n_rows at 64 cached tokens, rolled back each time."""
    model.cut(0)
    model.decode(PROMPT)
    times = []
    for _ in range(n_repeats):
        t0 = time.perf_counter()
        model.decode(PROMPT[:n_rows], all_rows=True)
        model.argmax(n_rows - 1)
        times.append(time.perf_counter() - t0)
        model.cut(len(PROMPT))
    return float(np.median(times))


def raw_runs(target_path: Path, draft_path: Path) -> dict[str, list]:
    """The raw loops, N_REPEATS each, alternating. Run in a process of their own: a thread that
    has decoded keeps its OpenMP team while it lives (the main thread, for good), and every
    graph of another thread's team then sleeps and wakes at each barrier (runtime/decoder.py):
    beside them in one process, specllama's plain decoding ran at 1.8x raw's time."""
    raw_target, raw_draft = Raw(target_path), Raw(draft_path)
    runs: dict[str, list] = {"raw plain": [], "raw chain": [],
                             "passes": [raw_pass(raw_target, 1), raw_pass(raw_target, 8), raw_pass(raw_draft, 1)]}
    for _ in range(N_REPEATS):
        runs["raw plain"].append(raw_plain(raw_target))
        runs["raw chain"].append(raw_chain(raw_target, raw_draft))
    raw_target.close()
    raw_draft.close()
    return runs


@pytest.mark.parametrize("kind", list(STAND_INS))
def test_engine_overhead_per_drafted_token_and_per_verify_pass(kind):
    target_path, draft_path = stand_in_pair(kind)
    settings = dict(n_ctx=1024, n_threads=N_THREADS, idle_work=False)
    with multiprocessing.get_context("spawn").Pool(1) as child:
        runs = child.apply(raw_runs, (target_path, draft_path))
    with specllama.load(target_path, None, **settings) as plain, \
            specllama.load(target_path, draft_path, exact="off", **settings) as pair, \
            specllama.load(target_path, draft_path, **settings) as default:
        runs.update({"plain": [], "chain": [], "default": [], "sampled": []})
        for _ in range(N_REPEATS):
            runs["plain"].append(spec_run(plain, n_draft=0))  # no draft model, and no prompt lookup either
            runs["chain"].append(spec_run(pair, n_draft=K, tree=1))
            runs["default"].append(spec_run(default, n_draft=K))
            runs["sampled"].append(spec_run(pair, n_draft=K, tree=1, temperature=1.0, seed=1))
    raw_plain_s = min(runs["raw plain"])
    raw_chain_s, raw_tpr = min(runs["raw chain"])
    plain_s = min(r["per_token"] for r in runs["plain"])
    one, eight, draft_step = runs["passes"]
    print(f"\n{kind} stand-in pair, {N_THREADS} threads, {N_TOKENS} greedy tokens, min of {N_REPEATS}: a target "
          f"pass of 1 row {one * 1e3:.3f} ms, of 8 rows {eight * 1e3:.3f} ms ({eight / one:.2f}x), a draft step "
          f"{draft_step * 1e3:.3f} ms ({draft_step / one:.2f} of a target step)")
    print(f"  raw plain        {raw_plain_s * 1e3:6.3f} ms a token")
    print(f"  specllama plain  {plain_s * 1e3:6.3f} ms a token ({plain_s / raw_plain_s:.2f}x raw)")
    print(f"  raw chain k={K}    {raw_chain_s * 1e3:6.3f} ms a token, {raw_tpr:.2f} tokens a round "
          f"({raw_plain_s / raw_chain_s:.2f}x raw plain)")
    for name, what in (("chain", 'exact="off", tree=1'), ("default", "the default level and trees"),
                       ("sampled", 'exact="off", tree=1, temperature 1, seeded')):
        run = min(runs[name], key=lambda r: r["per_token"])
        draft_own = (run["t_draft"] - run["llama_draft"]) / max(run["drafted"], 1)
        verify_own = (run["t_decode"] - run["t_draft"] - run["llama_target"]) / max(run["rounds"], 1)
        # what its llama.cpp calls alone allow at its acceptance: their time per token
        floor = (run["llama_draft"] + run["llama_target"]) / (len(run["tokens"]) - 1)
        print(f"  specllama n_draft={K}, {what}: {run['per_token'] * 1e3:.3f} ms a token, "
              f"{run['tokens_per_round']:.2f} tokens a round ({raw_plain_s / run['per_token']:.2f}x raw plain; its "
              f"llama.cpp calls alone allow {raw_plain_s / floor:.2f}x: it reaches {floor / run['per_token']:.0%} "
              "of that)")
        print(f"    engine's own: {draft_own * 1e3:.3f} ms a drafted token, {verify_own * 1e3:.3f} ms a verify pass "
              f"({run['drafted']} drafted, {run['rounds']} rounds)")
        assert run["drafted"] > 0 and run["llama_draft"] > 0


def test_the_draft_s_confidence_on_a_trained_model_s_rows():
    """The draft's confidence (softmax at its argmax, every drafted token) on the rows of the
    real 0.5B draft, against an exp of every entry. The stand-ins' random rows are peaked; a
    trained model's often are not, and picking the logits near the top out of such a row cost
    more than the exp: before FEW_NEAR, 481 us a row here against 168 us for the exp (0.63 ms
    a prose row), with FEW_NEAR 168 us."""
    from specllama.decoding.sampling import greedy, top_probability

    rows = []
    with specllama.load(fetch_models.path_of("draft"), None, n_ctx=1024, n_threads=N_THREADS,
                        idle_work=False) as llm:
        # code's rows are mostly peaked (a median 0.6% of the row within 20 of the top), prose's and
        # chat's are not (36% and 13%)
        for prompt in ("def quicksort(items):\n", "Once upon a time, in a small village by the sea,",
                       "<|im_start|>user\nExplain TCP slow start.<|im_end|>\n<|im_start|>assistant\n"):
            tokens = llm.tokenize(prompt) + llm.generate(prompt, max_tokens=24).tokens
            for n in range(len(tokens) - 24, len(tokens)):
                llm.target.sync(tokens[:n])
                rows.append(llm.target.logits(0).copy())

    def per_row(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(10):
            for row in rows:
                fn(row)
        return (time.perf_counter() - t0) / (10 * len(rows))

    every = per_row(lambda row: float(1.0 / np.exp(row - row.max()).sum()))
    confidence = per_row(lambda row: top_probability(row, greedy(row)))
    print(f"\nQwen 0.5B draft rows: the draft's confidence {confidence * 1e6:.0f} us a token "
          f"(argmax included), an exp of every entry {every * 1e6:.0f} us")
    assert confidence < 1.5 * every


def test_draft_steps_on_the_decode_thread_skip_the_hand_off():
    """A draft step's one-token decode handed to the decode thread from the caller's thread, and
    the same steps made on that thread (Runtime.drafting), the fastest of 150 runs of 16 steps
    each: the hand-off (a wake of each thread) is what the second leaves out."""
    target_path, draft_path = stand_in_pair("tiny")
    with specllama.load(draft_path, None, n_ctx=1024, n_threads=N_THREADS, idle_work=False) as llm:
        draft = llm.target
        draft.sync(PROMPT)

        def steps(n: int) -> float:
            t0 = time.perf_counter()
            for i in range(n):
                draft.decode([PROMPT[i]])
            seconds = time.perf_counter() - t0
            draft.truncate(len(PROMPT))
            return seconds / n

        handed, inside = [], []
        for _ in range(150):
            handed.append(steps(16))
            inside.append(draft.drafting(steps, 16))
    print(f"\ntiny draft step: {min(handed) * 1e3:.3f} ms handed off a step, {min(inside) * 1e3:.3f} ms on the "
          f"decode thread ({(min(handed) - min(inside)) * 1e6:.0f} us a step)")
    assert min(inside) < min(handed)
