"""specllama bench: your own prompts, plain against speculative, repeated and alternated."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

import click

from ..scheduling.batch import time_requests
from ..measuring.cores import SPARE_CORES, OtherProcesses
from .app import main
from .options import ModelChoice, model_options, plot_option
from .run import first_use


@main.command("bench")
@model_options
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs of every configuration, in a rotating order (machine drift spreads over all).")
@click.option("--raw", is_flag=True, help='Send "prompt" lines as they are, without the chat template.')
@click.option("--parallel", "-np", "n_parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Also run this many requests at once (the prompts in turn) against one at a time, as a "
                   "server with --parallel N would.")
@click.option("--batch-requests/--no-batch-requests", default=None,
              help="With --parallel: rows of a round in one pass, or not (default: as serve decides).")
@click.option("--json", "as_json", is_flag=True)
@plot_option
def bench_cmd(choice: ModelChoice, prompts_file: str, max_tokens: int, repeats: int, raw: bool, n_parallel: int,
              batch_requests: Optional[bool], as_json: bool, plot: Optional[Path]) -> None:
    """Run your own prompts plain vs speculative (auto and fixed lengths) and recommend settings.

    Each configuration runs --repeats times, the order rotating from one repeat to the next; a
    speedup is the median over repeats of its rate against plain decoding's in the same repeat,
    with the spread. "prompt" lines get the chat template as `run` does (--raw: not). With
    --parallel N, N requests then run at once and one after another, alternating: the aggregate
    tokens per second and each request's wait for its first token. --plot FILE.png draws the
    costs, the acceptance by draft position and the speed against draft length."""
    prompts = _read(prompts_file)
    with choice.open(n_parallel=n_parallel, batch_requests="auto" if batch_requests is None else batch_requests) as llm:
        first_use(llm, alone=n_parallel == 1)  # requests at once: how a prefill goes beside others too
        configs: list[Any] = [0, "auto"] + ([2, 4, 8] if llm.speculates else [])
        use_chat = not raw and llm.target.chat_template() is not None
        inputs = [llm.chat_tokens(p["messages"]) if "messages" in p else
                  llm.chat_tokens([{"role": "user", "content": p["prompt"]}]) if use_chat else llm.tokenize(p["prompt"])
                  for p in prompts]
        others = OtherProcesses()  # a benchmark beside other work times that work too
        rates: dict[Any, list[float]] = {c: [] for c in configs}
        ties = {c: 0 for c in configs}
        capped: dict[Any, int] = {}
        drafted_at: list[int] = []
        accepted_at: list[int] = []
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
                        _add_counts(drafted_at, r.stats.drafted_at)
                        _add_counts(accepted_at, r.stats.accepted_at)
                        bar.update(1)
                for config in configs:
                    rates[config].append(n[config] / t[config] if t[config] else 0.0)
        at_once = _at_once(llm, [inputs[i % len(inputs)] for i in range(n_parallel)], max_tokens, repeats) \
            if n_parallel > 1 else None
        used = others.cores()  # one reading: the figure and its excess agree
        machine = {"other_processes_cores": used, "n_cores": others.n_cores,
                   "n_threads": llm.target.n_threads, "excess": others.excess(llm.target.n_threads, used)}
        costs, name = llm.costs(), llm.target.name
    _report(choice, configs, rates, ties, capped, as_json, at_once, machine)
    if plot is not None:
        _plot(plot, name, costs, rates, drafted_at, accepted_at)


def _add_counts(total: list[int], counts: list[int]) -> None:
    total.extend([0] * (len(counts) - len(total)))
    for i, n in enumerate(counts):
        total[i] += n


def _plot(path: Path, name: str, costs: Any, rates: dict[Any, list[float]], drafted_at: list[int],
          accepted_at: list[int]) -> None:
    from ..plots import acceptance_by_position, draw

    if costs is None:
        click.echo(f"--plot: nothing drawn: no decode costs were measured (no draft for {name})", err=True)
        return
    speedups = {c: statistics.median(r / p if p else 0.0 for r, p in zip(rates[c], rates[0]))
                for c in rates if isinstance(c, int)}
    draw(path, f"{name}: bench", costs, acceptance_by_position(drafted_at, accepted_at),
         speedups, k_max=max(speedups))
    click.echo(f"drawn: {path}", err=True)


def _at_once(llm: Any, inputs: list[list[int]], max_tokens: int, repeats: int) -> dict[str, Any]:
    """len(inputs) requests at once and one after another, alternating which goes first: the
    medians over repeats of the aggregate tokens per second, the median and the longest wait
    for a first token (from the moment all were sent), and the one-after-another results."""
    runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    # untimed: the slots beyond the first are made when first needed, and each then holds a
    # prompt, as the one slot of one-at-a-time does after the table's runs
    time_requests(llm, inputs, True, max_tokens=1)
    with click.progressbar(length=2 * repeats, label=f"{len(inputs)} requests at once", file=sys.stderr) as bar:
        for repeat in range(repeats):
            for together in ((True, False) if repeat % 2 == 0 else (False, True)):
                runs[together].append(_requests(llm, inputs, max_tokens, together))
                bar.update(1)

    def summary(together: bool) -> dict[str, float]:
        rates, waits, longest = zip(*runs[together])
        return {"tokens_per_s": statistics.median(rates), "first_token_s": statistics.median(waits),
                "longest_first_token_s": statistics.median(longest)}

    return {"n_requests": len(inputs), "at_once": summary(True), "one_at_a_time": summary(False)}


def _requests(llm: Any, inputs: list[list[int]], max_tokens: int, together: bool) -> tuple[float, float, float]:
    """(aggregate tokens per second, median and longest wait for a first token) of the inputs
    streamed at once or one after another, all sent at the same moment."""
    timings, wall = time_requests(llm, inputs, together, max_tokens=max_tokens)
    firsts = [t.first_token_s for t in timings]
    return sum(t.n_tokens for t in timings) / wall, statistics.median(firsts), max(firsts)


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
            capped: dict[Any, int], as_json: bool, at_once: Any = None, machine: Optional[dict] = None) -> None:
    speedups = {c: [r / p if p else 0.0 for r, p in zip(rates[c], rates[0])] for c in configs}
    rows: list[dict[str, Any]] = [{"n_draft": "plain" if c == 0 else c, "tokens_per_s": statistics.median(rates[c]),
             "speedup": statistics.median(speedups[c]), "spread": [min(speedups[c]), max(speedups[c])],
             "near_ties": ties[c], "capped_at": capped.get(c)} for c in configs]
    # a difference within the spread of plain decoding's own repeats is noise, not a result
    noise = max(rates[0]) / min(rates[0]) - 1 if min(rates[0]) > 0 else 0.0
    best = max(configs, key=lambda c: statistics.median(speedups[c]))
    if best != 0 and statistics.median(speedups[best]) - 1 <= noise:
        best = 0
    if machine and (machine["excess"] or 0) > SPARE_CORES:
        click.echo(f"warning: the machine was busy: other processes used {machine['other_processes_cores']:.1f} of "
                   f"its {machine['n_cores']} cores on average while this ran, where the {machine['n_threads']} "
                   "threads needed them; these figures time that work too: run again when it is quiet", err=True)
    if as_json:
        click.echo(json.dumps({"results": rows, "recommended_n_draft": best, "fidelity": str(choice.exact),
                               "noise": noise, "machine": machine, **({"parallel": at_once} if at_once else {})}))
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
    if at_once:
        click.echo(f"{at_once['n_requests']} requests sent together (n_draft auto):")
        for key, label in (("one_at_a_time", "one at a time"), ("at_once", "at once")):
            row = at_once[key]
            click.echo(f"  {label:>14}: {row['tokens_per_s']:6.1f} tok/s in all; first token after "
                       f"{row['first_token_s']:.2f} s (median), {row['longest_first_token_s']:.2f} s (longest)")
