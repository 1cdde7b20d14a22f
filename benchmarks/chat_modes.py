"""The chat benchmark's conversation at 3,000 tokens of KV, auto against fixed draft lengths
and plain decoding, in one process, the modes alternating. For the controller at long context
(issue 29: auto within 0.95 of the best fixed length, and never locked out of the draft);
run on a quiet machine.

    .venv/bin/python benchmarks/chat_modes.py [--target target-f16] [--modes auto,3,0] [--repeats 2]

The conversation (benchmarks/test_chat.py: shlex.py in the system prompt, four questions,
128 tokens an answer, greedy) runs once to fill the prompt cache, then the idle work runs
(what a server does between turns), then each repeat decodes the four turns in every mode.
A pass reports its seconds, its rounds by source (plain, draft model, prompt lookup) and the
draft's acceptance of what it proposed. Each mode's passes start from what earlier passes
left: the pair's acceptance record and the costs, as in a long-running server.
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
from test_chat import N_CTX, N_TOKENS, QUESTIONS, system_messages  # noqa: E402


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
        messages, turns = system_messages(), []
        for question in QUESTIONS:
            messages = messages + [{"role": "user", "content": question}]
            turns.append(messages)
            messages = messages + [{"role": "assistant", "content": llm.chat(messages, max_tokens=N_TOKENS).text}]
        print(f"idle work: {', '.join(llm.warm_up())}", flush=True)
        for repeat in range(args.repeats):
            for mode in modes:
                t0, n_tokens, rounds, drafted, accepted = time.perf_counter(), 0, [0, 0, 0], 0, 0
                for turn in turns:
                    s = llm.chat(turn, max_tokens=N_TOKENS, n_draft=mode).stats
                    n_lookup = s.n_lookup_rounds
                    rounds = [rounds[0] + s.n_plain_rounds, rounds[1] + s.n_rounds - s.n_plain_rounds - n_lookup,
                              rounds[2] + n_lookup]
                    n_tokens, drafted, accepted = n_tokens + s.n_generated, drafted + s.n_drafted, \
                        accepted + s.n_accepted
                seconds = time.perf_counter() - t0
                print(f"repeat {repeat} n_draft={mode}: 4 turns {seconds:.1f}s ({n_tokens / seconds:.2f} tok/s); "
                      f"rounds plain {rounds[0]}, draft model {rounds[1]}, lookup {rounds[2]}; "
                      f"{accepted} of {drafted} proposed tokens accepted", flush=True)


if __name__ == "__main__":
    main()
