"""specllama bench: your own prompts, plain against speculative."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .app import main
from .options import ModelChoice, model_options


@main.command("bench")
@model_options
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_cmd(choice: ModelChoice, prompts_file: str, max_tokens: int, as_json: bool) -> None:
    """Run your own prompts plain vs speculative (auto and fixed lengths) and recommend settings."""
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
    llm = choice.open()
    configs: list[Any] = [0, "auto"] + ([2, 4, 8] if llm.speculates else [])
    totals = {c: [0, 0.0, 0] for c in configs}  # tokens, decode seconds, near-ties
    with llm, click.progressbar(length=len(prompts) * len(configs), label="benchmarking",
                                file=sys.stderr) as bar:
        for item in prompts:
            for config in configs:
                kwargs = dict(max_tokens=max_tokens, n_draft=config)
                r = llm.chat(item["messages"], **kwargs) if "messages" in item else \
                    llm.generate(item["prompt"], **kwargs)
                totals[config][0] += max(0, r.stats.n_generated - 1)
                totals[config][1] += r.stats.t_decode
                totals[config][2] += r.stats.near_ties or 0
                bar.update(1)
    rates = {c: (n / t if t else 0.0) for c, (n, t, _) in totals.items()}
    plain = rates[0] or 1e-9
    best = max(configs, key=lambda c: rates[c])
    rows = [{"n_draft": "plain" if c == 0 else c, "tokens_per_s": rates[c], "speedup": rates[c] / plain,
             "near_ties": totals[c][2]} for c in configs]
    if as_json:
        click.echo(json.dumps({"results": rows, "recommended_n_draft": best, "fidelity": str(choice.exact)}))
        return
    click.echo(f"{'n_draft':>8} {'tok/s':>8} {'speedup':>8} {'near-ties':>9}   (fidelity: {choice.exact})")
    for row in rows:
        click.echo(f"{str(row['n_draft']):>8} {row['tokens_per_s']:8.1f} {row['speedup']:7.2f}x {row['near_ties']:9}")
    if best == 0:
        click.echo("recommended: no speculation on this machine for these prompts (--draft none)")
    else:
        click.echo(f"recommended: --n-draft {best}")
