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
                     help="Draft: auto, none, ngram (prompt lookup), mtp (the target's own MTP layers), or a .gguf path / repo id / alias."),
        click.option("--n-draft", default=None, help="Tokens drafted per round, or auto (default)."),
        click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True, help="Context size in tokens."),
        click.option("--threads", "n_threads", type=int, default=None, help="CPU threads (default: llama.cpp's)."),
        click.option("--gpu-layers", "n_gpu_layers", type=int, default=-1, show_default=True,
                     help="Target layers to offload to Metal/CUDA (-1 = all)."),
        click.option("--draft-gpu-layers", "draft_n_gpu_layers", type=int, default=None,
                     help="Draft layers to offload (default: same as --gpu-layers)."),
        click.option("--exact", "exact", type=click.Choice(["bitwise", "rounding", "off"]), default="rounding",
                     show_default=True,
                     help="Fidelity: bitwise = token for token the target alone at any length; rounding = "
                          "verify batches that differ by float rounding only (near-ties counted); off = no limit."),
        click.option("--inexact", is_flag=True, hidden=True, help="Same as --exact off."),
        click.option("--rpc", default=None, envvar="SPECLLAMA_RPC_WORKERS",
                     help="host:port,... of llama.cpp RPC workers (specllama worker) that hold the target's "
                          "offloaded layers; the draft stays on this machine."),
        click.option("--tensor-split", default=None,
                     help="Share of the offloaded layers per device, e.g. 3,1 (default: by free memory)."),
        click.option("--draft-rpc", default=None, help="RPC workers for the draft too (default: none, local)."),
        click.option("--prompt-cache-mb", type=click.FloatRange(min=0), default=1024, show_default=True,
                     envvar="SPECLLAMA_PROMPT_CACHE_MB",
                     help="RAM for saved prompt-cache states of conversations switched away from "
                          "(0: only the live one is reused)."),
        click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp logs and full tracebacks."),
    ]):
        f = option(f)
    return f


def _load(model: str, draft: str, n_draft: Optional[int], n_ctx: int, n_threads: Optional[int],
          n_gpu_layers: int, draft_n_gpu_layers: Optional[int], exact: str, inexact: bool, rpc: Optional[str],
          tensor_split: Optional[str], draft_rpc: Optional[str], verbose: bool, prompt_cache_mb: float = 1024):
    from .draft_select import resolve_pair
    from .engine import load

    ngram = draft == "ngram"
    target_path, draft_path, notes = resolve_pair(model, None if ngram else draft)
    for note in notes:
        click.echo(note, err=True)
    settings: dict[str, Any] = dict(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, verbose=verbose)
    if draft_n_gpu_layers is not None:
        settings["draft_n_gpu_layers"] = draft_n_gpu_layers
    for key, value in (("rpc", rpc), ("tensor_split", tensor_split), ("draft_rpc", draft_rpc)):
        if value:
            settings[key] = value
    kwargs = {} if n_draft is None else {"n_draft": n_draft if n_draft == "auto" else _int_option("--n-draft", n_draft)}
    return load(target_path, "ngram" if ngram else draft_path, exact="off" if inexact else exact,
                prompt_cache_mb=prompt_cache_mb, **kwargs, **settings)


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
@click.option("--compare", is_flag=True,
              help="Then decode the same prompt plainly (target alone) and show both speeds side by side.")
@click.pass_context
def run(ctx: click.Context, model: str, prompt: Optional[str], draft: str, n_draft: Optional[int], n_ctx: int,
        n_threads: Optional[int], n_gpu_layers: int, draft_n_gpu_layers: Optional[int], exact: str, inexact: bool,
        rpc: Optional[str], tensor_split: Optional[str], draft_rpc: Optional[str],
        prompt_cache_mb: float, verbose: bool, max_tokens: int, temperature: float, top_k: int, top_p: float,
        min_p: float, seed: Optional[int], stop: tuple[str, ...], raw: bool, system: Optional[str], as_json: bool,
        compare: bool) -> None:
    """Generate from MODEL (a .gguf path, repo id or alias), streaming text to stdout.

    PROMPT comes from the argument or, if absent, from stdin. Stats go to stderr.
    """
    ctx.meta["specllama.verbose"] = verbose
    _setup_logging(verbose)
    if prompt is None:
        if sys.stdin.isatty():
            raise click.UsageError("give a PROMPT argument or pipe one on stdin")
        prompt = sys.stdin.read()
    llm = _load(model, draft, n_draft, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, exact, inexact,
                rpc, tensor_split, draft_rpc, verbose, prompt_cache_mb)
    with llm:
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, seed=seed, stop=list(stop))
        use_chat = not raw and llm.target.chat_template() is not None
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            tokens = llm.chat_tokens(messages)
        else:
            tokens = llm.tokenize(prompt)
        stream = llm.stream(tokens, **options)
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
        why_not = _why_not_speculating(llm, result.stats)
        if not as_json:
            click.echo()
            draft_name = llm.draft.name if llm.draft else ("prompt lookup" if llm.lookup else "no draft")
            click.echo(f"[{draft_name}] {result.stats.summary()}, finish: {result.finish_reason}", err=True)
            if why_not:
                click.echo(f"speculation off: {why_not}", err=True)
        plain = None
        if compare:
            if not as_json:
                click.echo("[decoding the same prompt plainly to compare ...]", err=True)
            plain = llm.generate(tokens, **{**options, "n_draft": 0})
        if as_json:
            out = {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                   "stats": result.stats.as_dict(),
                   "models": {"target": llm.target.name, "draft": llm.draft.name if llm.draft else None},
                   "speculation_off_because": why_not}
            if plain is not None:
                out["plain"] = {"stats": plain.stats.as_dict(), "identical": plain.tokens == result.tokens,
                                "speedup": _speedup(result, plain)}
            click.echo(json.dumps(out))
        elif plain is not None:
            _print_comparison(result, plain)


def _speedup(spec: Any, plain: Any) -> float:
    rate = plain.stats.decode_tokens_per_second
    return spec.stats.decode_tokens_per_second / rate if rate else 0.0


def _print_comparison(spec: Any, plain: Any) -> None:
    s, p = spec.stats, plain.stats
    click.echo(f"speculative: {s.n_generated} tokens at {s.decode_tokens_per_second:.1f} tok/s"
               + (f" ({s.n_accepted} of {s.n_drafted} drafts accepted, {s.n_lookup_rounds} rounds from prompt "
                  f"lookup)" if s.n_drafted else ""), err=True)
    click.echo(f"plain:       {p.n_generated} tokens at {p.decode_tokens_per_second:.1f} tok/s", err=True)
    if plain.tokens == spec.tokens:
        same = "the same output, token for token"
    else:
        first = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b),
                     min(len(spec.tokens), len(plain.tokens)))
        counted = "a near-tie it counted" if first in s.near_tie_positions else "NOT a counted near-tie"
        same = f"outputs differ from token {first} on, {counted} ({s.fidelity} level)"
    click.echo(f"speedup:     {_speedup(spec, plain):.2f}x, {same}", err=True)


def _why_not_speculating(llm: Any, stats: Any) -> Optional[str]:
    """One line on why a generation drafted nothing, or None when it drafted."""
    if stats.n_drafted:
        return None
    if not llm.speculates:
        return "no draft model (--draft auto found none, or --draft none)"
    if stats.verify_limits and max(stats.verify_limits.values()) <= 1:
        return (f"the {stats.fidelity} fidelity level allows no verify batch on this backend "
                f"(--exact rounding or off allows drafting)")
    c = stats.controller
    if c.get("kind") == "auto" and not c.get("draft_model"):
        v = c.get("v_ms", {})
        return (f"no draft length beats plain decoding on this machine: the target takes {v.get(1)} ms for one "
                f"token and {v.get(2)} ms to verify two, the draft {c.get('draft_token_ms')} ms a token"
                + ("; prompt lookup found nothing to copy" if c.get("lookup") else ""))
    return "no round was predicted to gain from drafting (acceptance too low for this text)"


def _setup_logging(verbose: bool) -> None:
    """specllama's own notes as "specllama: ..." on stderr; other libraries' only with --verbose."""
    logger = logging.getLogger("specllama")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("specllama: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
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
        stats = stream.stats
        n_ties = len(stats.near_tie_positions) if stats is not None else 0
        ties = f", {n_ties} near-ties" if n_ties else ""
        if stats is not None and stats.n_prompt_cached:
            ties += f", prompt {stats.n_prompt_cached / stats.n_prompt:.0%} cached"
        # save cursor, jump to the last column's line start is not portable; use a title-free \r line
        sys.stderr.write(f"\0337\r\n\033[2K  {self.n_tokens} tok, {rate:.1f} tok/s, {share:.0%} drafted "
                         f"({self.draft}){ties}\0338")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\0337\r\n\033[2K\0338")
        sys.stderr.flush()


@main.command("chat")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@_model_options
@click.option("--system", default=None, help="System message that starts the conversation.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Most tokens per answer (default: as many as the context has room for).")
@click.option("--temp", "temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=40, show_default=True)
@click.option("--top-p", type=float, default=0.95, show_default=True)
@click.option("--min-p", type=float, default=0.05, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stats", "show_stats", is_flag=True, help="Print each answer's figures after it (stderr).")
@click.pass_context
def chat_cmd(ctx: click.Context, model: str, draft: str, n_draft: Optional[str], n_ctx: int,
             n_threads: Optional[int], n_gpu_layers: int, draft_n_gpu_layers: Optional[int], exact: str,
             inexact: bool, rpc: Optional[str], tensor_split: Optional[str], draft_rpc: Optional[str],
             prompt_cache_mb: float, verbose: bool, system: Optional[str], max_tokens: Optional[int],
             temperature: float, top_k: int, top_p: float, min_p: float, seed: Optional[int],
             show_stats: bool) -> None:
    """Chat with MODEL in the terminal; the history and its prompt cache are kept between turns."""
    from .chat import chat_loop

    ctx.meta["specllama.verbose"] = verbose
    _setup_logging(verbose)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    llm = _load(model, draft, n_draft, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, exact, inexact,
                rpc, tensor_split, draft_rpc, verbose, prompt_cache_mb)
    options: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    with llm:
        if llm.target.chat_template() is None:
            raise click.ClickException(f"{llm.target.name} has no chat template in its GGUF; "
                                       "use `specllama run --raw` with a plain prompt")
        chat_loop(llm, options, system=system, show_stats=show_stats)


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
@click.option("--kv-groups", type=click.IntRange(1, 8), default=4, show_default=True,
              help="KV lengths to measure fidelity at: 256, 512, 768, 1280, ... (each longer one prefills more).")
@click.option("--json", "as_json", is_flag=True)
def calibrate_cmd(model: str, draft: str, n_ctx: int, n_threads: Optional[int], n_gpu_layers: int,
                  kv_groups: int, as_json: bool) -> None:
    """Measure (and cache) MODEL's verify-batch fidelity per KV length and this machine's decode costs."""
    from .calibrate import calibrate_fidelity, measure_costs, _store
    from .draft_select import resolve_pair
    from .engine import MAX_AUTO_DRAFT
    from .fidelity import LEVELS, group_label, kv_group
    from .runtime import ModelSettings, Runtime

    target_path, draft_path, notes = resolve_pair(model, draft)
    for note in notes:
        click.echo(note, err=True)
    settings = ModelSettings(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    with Runtime.load(target_path, settings) as target:
        draft_rt = Runtime.load(draft_path, settings) if draft_path else None
        try:
            fidelity = calibrate_fidelity(target, kv_groups)
            costs = measure_costs(target, draft_rt, MAX_AUTO_DRAFT + 1)
            key = f"costs|{target.identity}|{draft_rt.identity if draft_rt else '-'}|{MAX_AUTO_DRAFT + 1}"
            _store(key, {"verify": list(costs.verify), "draft_token": costs.draft_token})
        finally:
            if draft_rt is not None:
                draft_rt.close()
    levels = ("bitwise", "rounding")
    rows = [{"kv": group_label(kv_group(f.n_kv)), **f.as_dict(),
             **{f"max_verify_{name}": f.largest_batch(LEVELS[name].bound) for name in levels}} for f in fidelity]
    if as_json:
        click.echo(json.dumps({"fidelity": rows, "rounding_bound": LEVELS["rounding"].bound,
                               "verify_seconds": list(costs.verify), "draft_token_seconds": costs.draft_token}))
        return
    click.echo(f"largest |logit difference| of a verify batch of b tokens against single-token rows "
               f"(rounding level allows <= {LEVELS['rounding'].bound:g}):")
    for row in rows:
        diffs = " ".join(f"{d:.3g}" for d in row["diffs"])
        click.echo(f"  {row['kv']:>14}: b=2..{len(row['diffs']) + 1}: {diffs}")
        click.echo(f"  {'':>14}  largest verify batch: bitwise {row['max_verify_bitwise']}, "
                   f"rounding {row['max_verify_rounding']} (measured in {row['seconds']:.1f} s)")
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
              n_threads: Optional[int], n_gpu_layers: int, draft_n_gpu_layers: Optional[int], exact: str,
              inexact: bool, rpc: Optional[str], tensor_split: Optional[str], draft_rpc: Optional[str],
              prompt_cache_mb: float, verbose: bool, max_tokens: int, as_json: bool) -> None:
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
    llm = _load(model, draft, n_draft, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, exact, inexact,
                rpc, tensor_split, draft_rpc, verbose, prompt_cache_mb)
    configs: list[Any] = [0, "auto"] + ([2, 4, 8] if llm.speculates else [])
    totals = {c: [0, 0.0, 0] for c in configs}  # tokens, decode seconds, near-ties
    with llm, click.progressbar(length=len(prompts) * len(configs), label="benchmarking",
                                file=sys.stderr) as bar:
        for item in prompts:
            for config in configs:
                kwargs = dict(max_tokens=max_tokens, n_draft=config)
                r = llm.chat(item["messages"], **kwargs) if "messages" in item else llm.generate(item["prompt"], **kwargs)
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
        click.echo(json.dumps({"results": rows, "recommended_n_draft": best, "fidelity": exact}))
        return
    click.echo(f"{'n_draft':>8} {'tok/s':>8} {'speedup':>8} {'near-ties':>9}   (fidelity: {exact})")
    for row in rows:
        click.echo(f"{str(row['n_draft']):>8} {row['tokens_per_s']:8.1f} {row['speedup']:7.2f}x {row['near_ties']:9}")
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


@main.command("doctor")
@click.argument("model", required=False, envvar="SPECLLAMA_MODEL")
@click.option("--draft", default="auto", envvar="SPECLLAMA_DRAFT", show_default=True,
              help="Draft to judge with MODEL: auto, none, or a path / repo id / alias.")
@click.option("--ctx", "n_ctx", type=int, default=4096, show_default=True)
@click.option("--threads", "n_threads", type=int, default=None)
@click.option("--gpu-layers", "n_gpu_layers", type=int, default=-1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def doctor_cmd(model: Optional[str], draft: str, n_ctx: int, n_threads: Optional[int], n_gpu_layers: int,
               as_json: bool) -> None:
    """What this llama.cpp build can do here; with MODEL, its fidelity, costs and whether a draft pays."""
    from . import runtime
    from .doctor import describe_memory, model_report, system_report

    report = system_report()
    if model is not None:
        from .draft_select import MTP, resolve_pair
        from .plan import make_plan
        from .runtime import ModelSettings, Runtime

        target_path, draft_path, notes = resolve_pair(model, None if draft == "none" else draft)
        for note in notes:
            click.echo(note, err=True)
        settings = ModelSettings(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers)
        mtp = draft_path == MTP
        memory = make_plan(target_path, None if mtp else draft_path, settings, None,
                           gpu_offload=report["gpu_offload"])
        from .engine import TREE_BRANCHES

        with Runtime.load(target_path, settings, mtp=mtp, n_branches=TREE_BRANCHES) as target:
            draft_rt = target.mtp_head if mtp else Runtime.load(draft_path, settings) if draft_path else None
            try:
                report["model"] = {**model_report(target, draft_rt), "memory_plan": memory.describe(),
                                   "memory_fits": memory.fits}
            finally:
                if draft_rt is not None:
                    draft_rt.close()
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    info = report["llama_cpp"]
    click.echo(f"llama-cpp-python {info['llama_cpp_python']}: {info['system_info']}")
    click.echo(f"backends: {', '.join(report['backends'])}; GPU offload: {'yes' if report['gpu_offload'] else 'no'}; "
               f"RPC workers (--rpc, specllama worker): {'yes' if report['rpc'] else 'no, ' + runtime.NO_RPC_BUILD}")
    for d in report["devices"]:
        click.echo(f"  {d['name']} ({d['kind']}, {d['description']}): {d['free'] / 2**30:.1f} of "
                   f"{d['total'] / 2**30:.1f} GiB free")
    click.echo("GPUs on this machine: " + (", ".join(report["hardware_gpus"]) or "none found"))
    for warning in report["warnings"]:
        click.echo(f"warning: {warning}")
    m = report.get("model")
    if m:
        click.echo(f"\n{m['target']}" + (f" with draft {m['draft']}" if m["draft"] else "") + ":")
        click.echo("  " + m["memory_plan"].replace("\n", "\n  ") + ("" if m["memory_fits"] else "  (does not fit)"))
        for line in describe_memory(m["memory"]):
            click.echo(f"  {line}")
        click.echo(f"  largest verify batch (bitwise / rounding, bound {m['rounding_bound']:g} logits):")
        for row in m["fidelity"]:
            click.echo(f"    {row['kv']:>14}: {row['max_verify_bitwise']:2} / {row['max_verify_rounding']:2}"
                       f"   (largest difference {row['max_diff']:.3g})")
        v = m["costs_ms"]["v"]
        click.echo("  decode ms by batch size: " + ", ".join(f"{n}: {t}" for n, t in v.items())
                   + (f"; draft {m['costs_ms']['draft_token']} a token" if m["draft"] else ""))
        click.echo(f"  verdict: {m['verdict']}")


@main.command("serve")
@click.argument("model", envvar="SPECLLAMA_MODEL")
@_model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback only by default).")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--api-key", envvar="SPECLLAMA_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health.")
@click.option("--model-id", default=None, help="Name to serve the model under (default: the target file's stem).")
@click.option("--strict-model", is_flag=True,
              help="Answer 404 to requests naming another model (default: serve this one whatever the name).")
@click.option("--cors-origins", default="", envvar="SPECLLAMA_CORS_ORIGINS",
              help="Comma-separated origins browser apps may call from, or * for any (default: none).")
@click.pass_context
def serve_cmd(ctx: click.Context, model: str, draft: str, n_draft: Optional[str], n_ctx: int,
              n_threads: Optional[int], n_gpu_layers: int, draft_n_gpu_layers: Optional[int], exact: str,
              inexact: bool, rpc: Optional[str], tensor_split: Optional[str], draft_rpc: Optional[str],
              prompt_cache_mb: float, verbose: bool, host: str, port: int, api_key: Optional[str],
              model_id: Optional[str], strict_model: bool, cors_origins: str) -> None:
    """Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions)."""
    ctx.meta["specllama.verbose"] = verbose
    _setup_logging(verbose)
    try:
        import uvicorn

        from .server import create_app
    except ImportError as e:
        raise click.ClickException(f"specllama serve needs the server extra ({e.name} is missing): "
                                   "pip install 'specllama[server]'") from None
    from pathlib import Path

    from .draft_select import resolve_pair

    target_path, draft_path, notes = resolve_pair(model, None if draft == "ngram" else draft)
    for note in notes:
        click.echo(note, err=True)
    name = model_id or Path(target_path).stem

    def load():
        return _load(model, draft, n_draft, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, exact, inexact,
                     rpc, tensor_split, draft_rpc, verbose, prompt_cache_mb)

    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: listening on {host}, reachable from other machines"
                   + ("" if api_key else " with no --api-key"), err=True)
    click.echo(f"serving {name} on http://{host}:{port}/v1 (loading the model; /health says when it is ready)",
               err=True)
    origins = [o.strip() for o in cors_origins.split(",") if o.strip()]
    app = create_app(load, name, api_key, cors_origins=origins, strict_model=strict_model)
    uvicorn.run(app, host=host, port=port, log_level="info" if verbose else "warning")


@main.command("worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. llama.cpp's RPC protocol has no authentication: keep it on a trusted network.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep received tensors here, so a reload sends only their hashes.")
@click.option("--threads", "n_threads", type=click.IntRange(1), default=None,
              help="CPU threads when serving the CPU (default: all this process may use).")
def worker_cmd(host: str, port: int, cache_dir: Optional[str], n_threads: Optional[int]) -> None:
    """Serve this machine's GPU (or CPU) to a specllama or llama.cpp client over llama.cpp's RPC
    backend, until interrupted. Clients use it with --rpc HOST:PORT."""
    import ipaddress
    import os
    import signal
    import threading

    from . import runtime

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback:
        click.echo(f"warning: listening on {host}. llama.cpp's RPC protocol has no authentication or encryption: "
                   "anyone who can reach this port can run code on its devices and read what they hold. "
                   "Use it only on a network you trust.", err=True)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    endpoint = f"{host}:{port}"
    served = runtime.serve_rpc(endpoint, cache_dir, n_threads or runtime.cpu_count())
    for device in served:
        click.echo(f"worker: serving {device.name} ({device.description}), {device.free / 2**30:.1f} GiB free "
                   f"of {device.total / 2**30:.1f} GiB", err=True)
    click.echo(f"worker: listening on {endpoint}; use it with --rpc {endpoint} (Ctrl-C stops it)", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):  # the server runs in ggml's thread; this one waits for a signal
            pass
    except KeyboardInterrupt:
        pass
    click.echo("worker: stopped", err=True)
