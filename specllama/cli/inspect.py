"""What would run, and how it measures here: draft, models, plan, calibrate, doctor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import click

from .app import main
from .options import ModelChoice, model_options, plot_option


@main.command("draft")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
@click.option("--fresh", is_flag=True, help="Ignore the cached decision and search again.")
@click.option("--no-download", is_flag=True, help="Decide without downloading the chosen draft.")
@click.option("-v", "--verbose", is_flag=True, help="Full tracebacks.")
@click.pass_context
def draft_cmd(ctx: click.Context, model: str, as_json: bool, fresh: bool, no_download: bool, verbose: bool) -> None:
    """Show which draft auto-selection picks for MODEL, and why, without generating."""
    from ..models import registry as registry_module
    from ..models.draft_select import select_draft
    from ..models.hub import Hub
    from ..models.resolve import resolve

    ctx.meta["specllama.verbose"] = verbose
    hub, registry = Hub.from_env(), registry_module.load()
    target = resolve(model, hub, registry)
    decision = select_draft(target.path, hub, registry, repo_id=target.repo_id, filename=target.filename,
                            revision=target.revision, use_cache=not fresh, download=not no_download)
    if as_json:
        click.echo(json.dumps(decision.as_dict(), indent=1, default=str))
        return
    fp = decision.fingerprint
    click.echo(f"target: {decision.target}")
    click.echo(f"  {fp.basename} {fp.size_label} {fp.finetune} ({fp.architecture}), tokenizer {fp.tokenizer}/"
               f"{fp.tokenizer_pre}, {fp.n_vocab} tokens, vocab hash {fp.vocab_hash}")
    if decision.from_cache:
        click.echo("cached decision (run with --fresh to search again)")
    for i, c in enumerate(decision.candidates, 1):
        ratio = "" if c.size_ratio == float("inf") else f"{c.size_ratio:.0%} of target, "
        click.echo(f"{i:2}. [{c.source}] {c.label}: {ratio}{c.verdict}"
                   + (f": {c.reason}" if c.reason and c.verdict != "compatible" else ""))
    click.echo(f"header bytes fetched: {decision.header_bytes}")
    if decision.chosen is None:
        click.echo(f"no draft: {decision.reason}")
    else:
        click.echo(f"chosen: {decision.chosen.label}" + (f" -> {decision.draft_path}" if decision.draft_path else ""))
        if decision.warning:
            click.echo(f"warning: {decision.warning}")


@main.command("models")
@click.option("--json", "as_json", is_flag=True)
def models_cmd(as_json: bool) -> None:
    """List models.toml aliases and draft pairs (shipped + user file), and which are cached."""
    from ..models import registry as registry_module
    from ..models.hub import Hub

    registry = registry_module.load()
    cached = {repo for repo, _, _ in Hub.from_env().cached_ggufs()}
    if as_json:
        data = registry_module.as_dict(registry)
        data["cached_repos"] = sorted(cached)
        click.echo(json.dumps(data, indent=1))
        return
    click.echo("files: " + ", ".join(registry.sources))
    click.echo("aliases:")
    for name, ref in registry.aliases.items():
        mark = " (cached)" if ref.split(":")[0] in cached else ""
        click.echo(f"  {name:32} {ref}{mark}")
    click.echo("draft pairs:")
    for pair in registry.pairs:
        mark = "verified" if pair.verified else "not verified offline"
        draft_mark = " (cached)" if pair.draft.split(":")[0] in cached else ""
        click.echo(f"  {pair.family}: draft {pair.draft}{draft_mark} [{mark}]")
        for t in pair.targets:
            click.echo(f"      target {t}" + (" (cached)" if t in cached else ""))


@main.command("plan")
@model_options
def plan_cmd(choice: ModelChoice) -> None:
    """Show the memory MODEL and its draft need, from their headers, without loading them."""
    from ..models.draft_select import MTP
    from ..models.plan import make_plan, ways_out
    from ..runtime import ModelSettings
    from ..runtime.ggml import supports_gpu_offload

    target_path, draft_path = choice.resolve()
    target_settings, draft_settings = _settings(choice, ModelSettings)
    memory = make_plan(target_path, None if draft_path in (None, MTP) else draft_path, target_settings,
                       draft_settings, gpu_offload=supports_gpu_offload())
    click.echo(memory.describe())
    if memory.fits:
        click.echo("fits")
    else:
        raise click.ClickException("does not fit; ways out: " + "; ".join(ways_out(memory, target_settings.n_ctx)))


def _settings(choice: ModelChoice, settings_type: type) -> tuple:
    """(target settings, draft settings) as load() makes them from the command line."""
    values = choice.settings()
    draft_layers = values.pop("draft_n_gpu_layers", None)
    for key in ("rpc", "tensor_split", "draft_rpc"):
        values.pop(key, None)
    target = settings_type(**values)
    return target, None if draft_layers is None else dataclasses.replace(target, n_gpu_layers=draft_layers)


@main.command("calibrate")
@model_options
@click.option("--kv-groups", type=click.IntRange(1, 8), default=4, show_default=True,
              help="KV lengths to measure fidelity at: 256, 512, 768, 1280, ... (each longer one prefills more).")
@click.option("--fresh", is_flag=True, help="Measure again, replacing what is cached.")
@click.option("--json", "as_json", is_flag=True)
def calibrate_cmd(choice: ModelChoice, kv_groups: int, fresh: bool, as_json: bool) -> None:
    """Measure (and cache) MODEL's verify-batch fidelity per KV length and this machine's decode
    costs, loaded exactly as `run` loads it: what run, chat and serve then use."""
    from ..measuring import records
    from ..measuring.calibrate import calibrate_fidelity, costs_key
    from ..measuring.cost_probes import measure_costs
    from ..measuring.concurrency_probes import measure_pieces
    from ..measuring.fidelity import LEVELS, group_label, kv_group
    from ..decoding.limits import MAX_VERIFY

    with choice.open() as llm, llm.exclusive():
        fidelity = calibrate_fidelity(llm.target, kv_groups, fresh=fresh)
        key = costs_key(llm.target, llm.draft)
        record = None if fresh or not llm.planner.book.probed else llm.planner.book.record  # a probe's only
        for _ in range(3 if record is None else 0):  # a busy moment passes: measure again
            costs, evidence = measure_costs(llm.target, llm.draft, MAX_VERIFY)
            problem = records.costs_problem(costs.verify, costs.draft_token, **evidence)
            if problem is None:
                break
            click.echo(f"the machine looked busy while measuring ({problem}); measuring again", err=True)
        if record is None:
            if problem is not None:
                raise click.ClickException(f"the machine stayed busy while measuring ({problem}); nothing was "
                                           "cached: run it again when nothing else runs")
            record = records.write(key, records.costs_value(costs.verify, costs.draft_token, **evidence),
                                   "specllama calibrate")
        verify, draft_token = record["verify"], record["draft_token"]
        has_draft = llm.draft is not None
        pieces = measure_pieces(llm.pool.pieces, (llm.target, llm.draft), fresh) if llm.pool.slots.n_max > 1 else {}
    levels = ("bitwise", "rounding")
    rows = [{"kv": group_label(kv_group(f.n_kv)), **f.as_dict(),
             **{f"max_verify_{name}": f.largest_batch(LEVELS[name].bound) for name in levels}} for f in fidelity]
    if as_json:
        click.echo(json.dumps({"fidelity": rows, "rounding_bound": LEVELS["rounding"].bound,
                               "verify_seconds": list(verify), "draft_token_seconds": draft_token,
                               "costs_measured": records.describe(record), "prefill_piece_diffs": pieces}))
        return
    click.echo(f"largest |logit difference| of a verify batch of b tokens against single-token rows "
               f"(rounding level allows <= {LEVELS['rounding'].bound:g}):")
    for row in rows:
        diffs = " ".join(f"{d:.3g}" for d in row["diffs"])
        click.echo(f"  {row['kv']:>14}: b=2..{len(row['diffs']) + 1}: {diffs}")
        click.echo(f"  {'':>14}  largest verify batch: bitwise {row['max_verify_bitwise']}, "
                   f"rounding {row['max_verify_rounding']} (measured in {row['seconds']:.1f} s)")
    click.echo("target decode time by batch size: " +
               ", ".join(f"{n}: {verify[n - 1] * 1000:.0f} ms" for n in (1, 2, 3, 4, 6, 8, 12, 16))
               + f" ({records.describe(record)})")
    if has_draft:
        click.echo(f"draft: {draft_token * 1000:.1f} ms per token ({draft_token / verify[0]:.0%} of a target step)")
    for name, diff in pieces.items():
        click.echo(f"{name}: a prompt prefilled in pieces beside other requests differs from whole chunks by "
                   f"{diff:.3g} logits: " + ("pieces" if diff == 0 else "whole chunks"))


@main.command("doctor")
@model_options(required=False)
@click.option("--json", "as_json", is_flag=True)
@plot_option
def doctor_cmd(choice: Optional[ModelChoice], as_json: bool, plot: Optional[Path]) -> None:
    """What this llama.cpp build can do here; with MODEL, its fidelity, costs and whether a draft
    pays, loaded exactly as `run` loads it (--plot FILE.png: the costs drawn)."""
    from ..doctor import model_report, print_report, system_report
    from ..models.draft_select import MTP
    from ..models.plan import make_plan
    from ..runtime import ModelSettings

    if plot is not None and choice is None:
        raise click.BadParameter("give a MODEL to draw its costs", param_hint="--plot")
    report = system_report()
    if choice is not None:
        target_path, draft_path = choice.resolve()
        target_settings, draft_settings = _settings(choice, ModelSettings)
        memory = make_plan(target_path, None if draft_path in (None, MTP) else draft_path, target_settings,
                           draft_settings, gpu_offload=report["gpu_offload"])
        with choice.open() as llm:
            report["model"] = {**model_report(llm), "memory_plan": memory.describe(), "memory_fits": memory.fits}
            if plot is not None:
                _plot_costs(plot, llm)
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    for line in print_report(report):
        click.echo(line)


def _plot_costs(path: Path, llm: Any) -> None:
    """The measured costs, and the speed they allow against draft length were every draft kept."""
    from ..plots import draw

    costs = llm.costs()
    if costs is None or llm.draft is None:
        click.echo(f"--plot: nothing drawn: {llm.target.name} has no draft, so no draft costs", err=True)
        return
    draw(path, f"{llm.target.name}, drafted by {llm.draft.name}: doctor", costs)
    click.echo(f"drawn: {path}", err=True)
