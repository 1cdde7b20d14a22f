"""The specllama command line. Library errors become one line with the next step."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from typing import Any, Optional

import click

from . import __version__
from .errors import SpecLlamaError


class _Group(click.Group):
    """Formats specllama's errors as one line (full traceback with --verbose)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (SpecLlamaError, ValueError, FileNotFoundError) as e:
            if ctx.meta.get("specllama.verbose"):
                raise
            raise click.ClickException(f"{type(e).__name__}: {e}") from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specllama")
def main() -> None:
    """Faster GGUF generation with a draft model, with the target model's exact output."""


def _model_options(f):
    for option in reversed([
        click.option("--draft", "draft", default="auto", envvar="SPECLLAMA_DRAFT", show_default=True,
                     help="Draft: auto, none, ngram (prompt lookup), or a .gguf path / repo id / alias."),
        click.option("--n-draft", default=None, help="Tokens drafted per round, or auto (default)."),
        click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True, help="Context size in tokens."),
        click.option("--threads", "n_threads", type=int, default=None, help="CPU threads (default: llama.cpp's)."),
        click.option("--gpu-layers", "n_gpu_layers", type=int, default=-1, show_default=True,
                     help="Target layers to offload to Metal/CUDA (-1 = all)."),
        click.option("--draft-gpu-layers", "draft_n_gpu_layers", type=int, default=None,
                     help="Draft layers to offload (default: same as --gpu-layers)."),
        click.option("--inexact", is_flag=True,
                     help="Verify drafts in batches larger than the size measured to match the target "
                          "bit for bit (faster on some backends; near-ties may resolve differently)."),
        click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp logs and full tracebacks."),
    ]):
        f = option(f)
    return f


def _load(model: str, draft: str, n_draft: Optional[int], n_ctx: int, n_threads: Optional[int],
          n_gpu_layers: int, draft_n_gpu_layers: Optional[int], inexact: bool, verbose: bool):
    from .draft_select import resolve_pair
    from .engine import load

    ngram = draft == "ngram"
    target_path, draft_path, notes = resolve_pair(model, None if ngram else draft)
    for note in notes:
        click.echo(note, err=True)
    settings: dict[str, Any] = dict(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, verbose=verbose)
    if draft_n_gpu_layers is not None:
        settings["draft_n_gpu_layers"] = draft_n_gpu_layers
    kwargs = {} if n_draft is None else {"n_draft": n_draft if n_draft == "auto" else _int_option("--n-draft", n_draft)}
    return load(target_path, "ngram" if ngram else draft_path, exact=not inexact, **kwargs, **settings)


@main.command()
@click.argument("model", envvar="SPECLLAMA_MODEL")
@click.argument("prompt", required=False)
@_model_options
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temp", "temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=40, show_default=True)
@click.option("--top-p", type=float, default=0.95, show_default=True)
@click.option("--min-p", type=float, default=0.05, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the model's chat template.")
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result instead of streaming text.")
@click.pass_context
def run(ctx: click.Context, model: str, prompt: Optional[str], draft: str, n_draft: Optional[int], n_ctx: int,
        n_threads: Optional[int], n_gpu_layers: int, draft_n_gpu_layers: Optional[int], inexact: bool,
        verbose: bool, max_tokens: int, temperature: float, top_k: int, top_p: float, min_p: float,
        seed: Optional[int], stop: tuple[str, ...], raw: bool, system: Optional[str], as_json: bool) -> None:
    """Generate from MODEL (a .gguf path, repo id or alias), streaming text to stdout.

    PROMPT comes from the argument or, if absent, from stdin. Stats go to stderr.
    """
    ctx.meta["specllama.verbose"] = verbose
    _setup_logging(verbose)
    if prompt is None:
        if sys.stdin.isatty():
            raise click.UsageError("give a PROMPT argument or pipe one on stdin")
        prompt = sys.stdin.read()
    llm = _load(model, draft, n_draft, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, inexact, verbose)
    with llm:
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, seed=seed, stop=list(stop))
        use_chat = not raw and llm.target.chat_template() is not None
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            stream = llm.chat_stream(messages, **options)
        else:
            stream = llm.stream(prompt, **options)
        status = _StatusLine(llm) if (sys.stderr.isatty() and not as_json) else None
        for chunk in stream:
            if not as_json:
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
            if status is not None:
                status.update(stream, chunk)
        result = stream.result
        if status is not None:
            status.clear()
        if as_json:
            click.echo(json.dumps({
                "text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                "stats": result.stats.as_dict(),
                "models": {"target": llm.target.name, "draft": llm.draft.name if llm.draft else None},
            }))
        else:
            click.echo()
            draft_name = llm.draft.name if llm.draft else ("prompt lookup" if llm.lookup else "no draft")
            if llm.speculates and result.stats.n_draft_max == 0:
                draft_name += ": not used, no draft length beats plain decoding here"
            click.echo(f"[{draft_name}] {result.stats.summary()}, finish: {result.finish_reason}", err=True)


def _setup_logging(verbose: bool) -> None:
    """specllama's own warnings as "specllama: ..." on stderr; other libraries' only with --verbose."""
    logger = logging.getLogger("specllama")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("specllama: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False
    if not verbose:
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


def _int_option(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise click.BadParameter(f"{value!r} is not an integer or auto", param_hint=name) from None


class _StatusLine:
    """A live line on stderr: tokens, speed, acceptance, draft in use."""

    def __init__(self, llm: Any):
        self.draft = llm.draft.name if llm.draft else "no draft"
        self.t_start = time.perf_counter()
        self.n_tokens = 0
        self.n_from_draft = 0
        self.t_last = 0.0

    def update(self, stream: Any, chunk: Any) -> None:
        self.n_tokens += len(chunk.tokens)
        self.n_from_draft += sum(chunk.from_draft)
        now = time.perf_counter()
        if now - self.t_last < 0.25:
            return
        self.t_last = now
        rate = self.n_tokens / max(now - self.t_start, 1e-9)
        share = self.n_from_draft / self.n_tokens if self.n_tokens else 0.0
        # save cursor, jump to the last column's line start is not portable; use a title-free \r line
        sys.stderr.write(f"\0337\r\n\033[2K  {self.n_tokens} tok, {rate:.1f} tok/s, {share:.0%} drafted ({self.draft})\0338")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\0337\r\n\033[2K\0338")
        sys.stderr.flush()


@main.command("draft")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
@click.option("--fresh", is_flag=True, help="Ignore the cached decision and search again.")
@click.option("--no-download", is_flag=True, help="Decide without downloading the chosen draft.")
@click.option("-v", "--verbose", is_flag=True, help="Full tracebacks.")
@click.pass_context
def draft_cmd(ctx: click.Context, model: str, as_json: bool, fresh: bool, no_download: bool, verbose: bool) -> None:
    """Show which draft auto-selection picks for MODEL, and why, without generating."""
    from . import registry as registry_module
    from .draft_select import select_draft
    from .hub import Hub
    from .resolve import resolve

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
    from . import registry as registry_module
    from .hub import Hub

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


@main.command("calibrate")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@click.option("--draft", default="auto", envvar="SPECLLAMA_DRAFT", show_default=True,
              help="Draft model to time as well: auto, none, or a path / repo id / alias.")
@click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True)
@click.option("--threads", "n_threads", type=int, default=None)
@click.option("--gpu-layers", "n_gpu_layers", type=int, default=-1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def calibrate_cmd(model: str, draft: str, n_ctx: int, n_threads: Optional[int], n_gpu_layers: int,
                  as_json: bool) -> None:
    """Measure (and cache) this machine's decode costs and exact verify batch size for MODEL."""
    from .calibrate import measure_costs, _store, invariant_batch_size
    from .draft_select import resolve_pair
    from .engine import MAX_AUTO_DRAFT, MAX_N_DRAFT
    from .runtime import ModelSettings, Runtime

    target_path, draft_path, notes = resolve_pair(model, draft)
    for note in notes:
        click.echo(note, err=True)
    settings = ModelSettings(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    with Runtime.load(target_path, settings) as target:
        draft_rt = Runtime.load(draft_path, settings) if draft_path else None
        try:
            batch = invariant_batch_size(target, MAX_N_DRAFT + 1)
            costs = measure_costs(target, draft_rt, MAX_AUTO_DRAFT + 1)
            key = f"costs|{target.identity}|{draft_rt.identity if draft_rt else '-'}|{MAX_AUTO_DRAFT + 1}"
            _store(key, {"verify": list(costs.verify), "draft_token": costs.draft_token})
        finally:
            if draft_rt is not None:
                draft_rt.close()
    if as_json:
        click.echo(json.dumps({"exact_verify_batch": batch, "verify_seconds": list(costs.verify),
                               "draft_token_seconds": costs.draft_token}))
        return
    click.echo(f"verify batches bitwise identical to one-token decoding: up to {batch} tokens "
               f"(exact mode drafts at most {batch - 1})")
    click.echo("target decode time by batch size: " +
               ", ".join(f"{n}: {costs.v(n) * 1000:.0f} ms" for n in (1, 2, 3, 4, 6, 8, 12, 16)))
    if draft_path:
        click.echo(f"draft: {costs.draft_token * 1000:.1f} ms per token "
                   f"({costs.draft_token / costs.v(1):.0%} of a target step)")


@main.command("bench")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')
@_model_options
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def bench_cmd(ctx: click.Context, model: str, prompts_file: str, draft: str, n_draft: Optional[int], n_ctx: int,
              n_threads: Optional[int], n_gpu_layers: int, draft_n_gpu_layers: Optional[int], inexact: bool,
              verbose: bool, max_tokens: int, as_json: bool) -> None:
    """Run your own prompts plain vs speculative (auto and fixed lengths) and recommend settings."""
    ctx.meta["specllama.verbose"] = verbose
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
    llm = _load(model, draft, n_draft, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, inexact, verbose)
    configs: list[Any] = [0, "auto"] + ([2, 4, 8] if llm.speculates else [])
    totals = {c: [0, 0.0] for c in configs}  # tokens, decode seconds
    with llm, click.progressbar(length=len(prompts) * len(configs), label="benchmarking",
                                file=sys.stderr) as bar:
        for item in prompts:
            for config in configs:
                kwargs = dict(max_tokens=max_tokens, n_draft=config)
                r = llm.chat(item["messages"], **kwargs) if "messages" in item else llm.generate(item["prompt"], **kwargs)
                totals[config][0] += max(0, r.stats.n_generated - 1)
                totals[config][1] += r.stats.t_decode
                bar.update(1)
    rates = {c: (n / t if t else 0.0) for c, (n, t) in totals.items()}
    plain = rates[0] or 1e-9
    best = max(configs, key=lambda c: rates[c])
    rows = [{"n_draft": "plain" if c == 0 else c, "tokens_per_s": rates[c], "speedup": rates[c] / plain} for c in configs]
    if as_json:
        click.echo(json.dumps({"results": rows, "recommended_n_draft": best}))
        return
    click.echo(f"{'n_draft':>8} {'tok/s':>8} {'speedup':>8}")
    for row in rows:
        click.echo(f"{str(row['n_draft']):>8} {row['tokens_per_s']:8.1f} {row['speedup']:7.2f}x")
    if best == 0:
        click.echo("recommended: no speculation on this machine for these prompts (--draft none)")
    else:
        click.echo(f"recommended: --n-draft {best}")


@main.command("plan")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@click.option("--draft", default="auto", envvar="SPECLLAMA_DRAFT", show_default=True)
@click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True)
@click.option("--gpu-layers", "n_gpu_layers", type=int, default=-1, show_default=True)
@click.option("--draft-gpu-layers", "draft_n_gpu_layers", type=int, default=None)
@click.option("--cache-type", "cache_type", default=None, help="KV cache type for K and V (f16, q8_0, ...).")
def plan_cmd(model: str, draft: str, n_ctx: int, n_gpu_layers: int, draft_n_gpu_layers: Optional[int],
             cache_type: Optional[str]) -> None:
    """Show the memory MODEL and its draft need, from their headers, without loading them."""
    from .draft_select import resolve_pair
    from .plan import make_plan, ways_out
    from .runtime import ModelSettings, supports_gpu_offload

    target_path, draft_path, notes = resolve_pair(model, None if draft == "ngram" else draft)
    for note in notes:
        click.echo(note, err=True)
    settings = ModelSettings(n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, type_k=cache_type, type_v=cache_type)
    draft_settings = None if draft_n_gpu_layers is None else \
        dataclasses.replace(settings, n_gpu_layers=draft_n_gpu_layers)
    memory = make_plan(target_path, draft_path, settings, draft_settings, gpu_offload=supports_gpu_offload())
    click.echo(memory.describe())
    if memory.fits:
        click.echo("fits")
    else:
        raise click.ClickException("does not fit; ways out: " + "; ".join(ways_out(memory, n_ctx)))
