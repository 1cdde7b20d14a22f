"""Where a workload's time goes, per configuration: rounds by source, drafted and accepted
tokens, drafting and verify seconds. For tuning the controller (issue 10); run on a quiet
machine, since another llama.cpp process on the same cores makes every figure meaningless.

    .venv/bin/python benchmarks/rounds.py edit [--target target-f16] [--repeats 2] [--tokens 128] [--fixed 2,5]
    .venv/bin/python benchmarks/rounds.py long --ctx 6144 --fixed 2,3,5   # 2,900 tokens of KV first
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import specllama

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_models  # noqa: E402
from workloads import LONG_WORKLOADS, WORKLOADS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workloads = {**WORKLOADS, **LONG_WORKLOADS}
    parser.add_argument("workload", choices=sorted(workloads))
    parser.add_argument("--target", default="target-f16", help="a fetch_models name (target, target-f16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--fixed", default="5", help="fixed draft lengths to compare, comma-separated")
    parser.add_argument("--ctx", type=int, default=2048)
    args = parser.parse_args()
    target, draft = fetch_models.path_of(args.target), fetch_models.path_of("draft")
    messages = [{"role": "user", "content": workloads[args.workload]}]
    # no idle thread measuring between timed runs: what it would measure runs once, untimed
    with specllama.load(target, draft, n_ctx=args.ctx, idle_work=False) as pair, \
            specllama.load(target, "ngram", n_ctx=args.ctx, idle_work=False) as lookup:
        for llm in (pair, lookup):  # the prompt once, then what idle work measures at its length
            llm.chat(messages, max_tokens=4)
            llm.warm_up()
        configs = [("plain", pair, 0, 1), ("auto", pair, "auto", "auto"), ("auto chains", pair, "auto", 1),
                   ("lookup alone", lookup, "auto", 1)]
        configs += [(f"k={k}", pair, int(k), 1) for k in args.fixed.split(",")]
        for repeat in range(args.repeats):
            rates = {}
            for name, llm, n_draft, tree in configs:
                s = llm.chat(messages, max_tokens=args.tokens, n_draft=n_draft, tree=tree).stats
                rates[name] = s.decode_tokens_per_second
                n_draft_rounds = s.n_rounds - s.n_plain_rounds - s.n_lookup_rounds
                print(f"[{repeat}] {name:12} {s.decode_tokens_per_second:6.2f} tok/s "
                      f"({rates[name] / rates['plain']:.2f}x)  rounds {s.n_rounds}: {s.n_plain_rounds} plain, "
                      f"{s.n_lookup_rounds} lookup, {n_draft_rounds} draft ({s.n_tree_rounds} trees, "
                      f"{s.n_branch_accepted} tokens from branches); drafted {s.n_drafted}, accepted "
                      f"{s.n_accepted}; drafting {s.t_draft:.2f} s, verify {s.t_verify:.2f} s", flush=True)


if __name__ == "__main__":
    main()
