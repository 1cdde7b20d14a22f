"""The chat benchmark's conversation at 3,000 tokens of KV, auto against fixed draft lengths
and plain decoding, in one process, the modes alternating. For the controller at long context
(issue 29: auto within 0.95 of the best fixed length, and never locked out of the draft);
run on a quiet machine.

    .venv/bin/python benchmarks/chat_modes.py [--target target-f16] [--modes auto,3,0] [--repeats 2]

The conversation (benchmarks/test_chat.py: shlex.py in the system prompt, four questions,
128 tokens an answer, greedy) runs once to fill the prompt cache, then the idle work runs
(what a server does between turns), then each repeat decodes the four turns in every mode.
A pass reports its seconds, its rounds by source (plain, draft model, prompt lookup), the
draft's acceptance of what it proposed, and each turn's milliseconds per token after the
first. Each mode's passes start from what earlier passes left: the pair's acceptance record
and the costs, as in a long-running server.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_models  # noqa: E402
from test_chat import N_CTX, N_TOKENS, chat_turns  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="target-f16", help="a fetch_models name (target, target-f16)")
    parser.add_argument("--modes", default="auto,3,0", help="n_draft values, comma-separated (0: plain)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("SPECLLAMA_HOME", tempfile.mkdtemp(prefix="specllama-chat-modes-"))
    import specllama

    modes = [m if m == "auto" else int(m) for m in args.modes.split(",")]
    with specllama.load(fetch_models.path_of(args.target), fetch_models.path_of("draft"), n_ctx=N_CTX,
                        flash_attn=False, idle_work=False) as llm:
        turns: list[list[dict]] = []

        def first_pass(messages):  # the conversation as chat_turns builds it, each turn's messages kept
            turns.append(messages)
            return llm.chat(messages, max_tokens=N_TOKENS).text, 0.0, 0.0, {}

        chat_turns(first_pass)
        print(f"idle work: {', '.join(llm.warm_up())}", flush=True)
        for repeat in range(args.repeats):
            for mode in modes:
                t0 = time.perf_counter()
                stats = [llm.chat(turn, max_tokens=N_TOKENS, n_draft=mode).stats for turn in turns]
                seconds = time.perf_counter() - t0
                n_plain, n_lookup = sum(s.n_plain_rounds for s in stats), sum(s.n_lookup_rounds for s in stats)
                n_draft = sum(s.n_rounds for s in stats) - n_plain - n_lookup
                print(f"repeat {repeat} n_draft={mode}: {len(turns)} turns {seconds:.1f}s "
                      f"({sum(s.n_generated for s in stats) / seconds:.2f} tok/s); rounds plain {n_plain}, "
                      f"draft model {n_draft}, lookup {n_lookup}; {sum(s.n_accepted for s in stats)} of "
                      f"{sum(s.n_drafted for s in stats)} proposed tokens accepted; ms/token by turn "
                      + " ".join(f"{1e3 * (s.t_total - s.t_prefill) / max(1, s.n_generated - 1):.0f}" for s in stats),
                      flush=True)


if __name__ == "__main__":
    main()
