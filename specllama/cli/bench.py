"""specllama bench: your own prompts, plain against speculative, repeated and alternated."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import click

from .app import main
from .options import ModelChoice, model_options
from .run import first_use


@main.command("bench")
@model_options
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs of every configuration, in a rotating order (machine drift spreads over all).")
@click.option("--raw", is_flag=True, help='Send "prompt" lines as they are, without the chat template.')
@click.option("--json", "as_json", is_flag=True)
def bench_cmd(choice: ModelChoice, prompts_file: str, max_tokens: int, repeats: int, raw: bool,
              as_json: bool) -> None:
    """Run your own prompts plain vs speculative (auto and fixed lengths) and recommend settings.

    Each configuration runs --repeats times, the order rotating from one repeat to the next; a
    speedup is the median over repeats of its rate against plain decoding's in the same repeat,
    with the spread. "prompt" lines get the chat template as `run` does (--raw: not)."""
    prompts = _read(prompts_file)
    with choice.open() as llm:
        first_use(llm)
        configs: list[Any] = [0, "auto"] + ([2, 4, 8] if llm.speculates else [])
        use_chat = not raw and llm.target.chat_template() is not None
        inputs = [llm.chat_tokens(p["messages"]) if "messages" in p else
                  llm.chat_tokens([{"role": "user", "content": p["prompt"]}]) if use_chat else llm.tokenize(p["prompt"])
                  for p in prompts]
        rates: dict[Any, list[float]] = {c: [] for c in configs}
        ties = {c: 0 for c in configs}
        capped: dict[Any, int] = {}
        with click.progressbar(length=repeats * len(inputs) * len(configs), label="benchmarking",
                               file=sys.stderr) as bar:
            for repeat in range(repeats):
                order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
                n, t = {c: 0 for c in configs}, {c: 0.0 for c in configs}
                for tokens in inputs:
                    for config in order:
                        r = llm.generate(tokens, max_tokens=max_tokens, n_draft=config)
                        n[config] += max(0, r.stats.n_generated - 1)
                        t[config] += r.stats.t_decode + r.stats.t_draft_prefill
                        ties[config] += r.stats.near_ties or 0
                        if isinstance(config, int) and config and r.stats.n_draft_max < config:
                            capped[config] = r.stats.n_draft_max
                        bar.update(1)
                for config in configs:
                    rates[config].append(n[config] / t[config] if t[config] else 0.0)
    _report(choice, configs, rates, ties, capped, as_json)


def _read(prompts_file: str) -> list[dict]:
    prompts = []
    for i, line in enumerate(open(prompts_file, encoding="utf-8"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise click.BadParameter(f"line {i} is not JSON: {e}", param_hint="--prompts") from None
        if not isinstance(item, dict) or not ({"prompt", "messages"} & set(item)):
            raise click.BadParameter(f'line {i} needs a "prompt" or "messages" key', param_hint="--prompts")
        prompts.append(item)
    if not prompts:
        raise click.BadParameter("the file has no prompts", param_hint="--prompts")
    return prompts


def _report(choice: ModelChoice, configs: list[Any], rates: dict[Any, list[float]], ties: dict[Any, int],
            capped: dict[Any, int], as_json: bool) -> None:
    speedups = {c: [r / p if p else 0.0 for r, p in zip(rates[c], rates[0])] for c in configs}
    rows: list[dict[str, Any]] = [{"n_draft": "plain" if c == 0 else c, "tokens_per_s": statistics.median(rates[c]),
             "speedup": statistics.median(speedups[c]), "spread": [min(speedups[c]), max(speedups[c])],
             "near_ties": ties[c], "capped_at": capped.get(c)} for c in configs]
    # a difference within the spread of plain decoding's own repeats is noise, not a result
    noise = max(rates[0]) / min(rates[0]) - 1 if min(rates[0]) > 0 else 0.0
    best = max(configs, key=lambda c: statistics.median(speedups[c]))
    if best != 0 and statistics.median(speedups[best]) - 1 <= noise:
        best = 0
    if as_json:
        click.echo(json.dumps({"results": rows, "recommended_n_draft": best, "fidelity": str(choice.exact),
                               "noise": noise}))
        return
    click.echo(f"{'n_draft':>8} {'tok/s':>8} {'speedup':>8} {'spread':>13} {'near-ties':>9}   "
               f"(fidelity: {choice.exact}; plain decoding's own runs vary by {noise:.0%})")
    for row in rows:
        note = f"  capped at {row['capped_at']} by the fidelity level" if row["capped_at"] is not None else ""
        spread = f"{row['spread'][0]:.2f}-{row['spread'][1]:.2f}x"
        click.echo(f"{str(row['n_draft']):>8} {row['tokens_per_s']:8.1f} {row['speedup']:7.2f}x {spread:>13} "
                   f"{row['near_ties']:9}{note}")
    if best == 0:
        click.echo("recommended: no speculation on this machine for these prompts (--draft none): nothing beat "
                   "plain decoding by more than its own run-to-run spread")
    else:
        click.echo(f"recommended: --n-draft {best}" + (f" (drafts {capped[best]} at this fidelity level)"
                                                       if best in capped else ""))
