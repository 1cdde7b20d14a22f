"""specllama run and specllama chat: generate in the terminal."""

from __future__ import annotations

import json
from dataclasses import replace
import sys
import time
from typing import Any, Optional

import click

from ..options import GenerateOptions
from .app import main
from .screen import ColorLegend, PrefillBar, Screen, install_notes, style_of
from .options import ModelChoice, color_option, generation_options, model_options


@main.command()
@model_options
@click.argument("prompt", required=False)
@generation_options
@click.option("--prompt", "-p", "prompt_option", default=None, help="The prompt (instead of PROMPT).")
@click.option("--file", "-f", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from this file.")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the model's chat template.")
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result instead of streaming text.")
@click.option("--compare", is_flag=True,
              help="Then decode the same prompt plainly (target alone) and show both speeds side by side.")
@color_option
def run(choice: ModelChoice, prompt: Optional[str], gen: GenerateOptions, prompt_option: Optional[str],
        prompt_file: Optional[str], raw: bool, system: Optional[str], as_json: bool, compare: bool,
        color: bool) -> None:
    """Generate from MODEL (a .gguf path, repo id or alias), streaming text to stdout.

    PROMPT comes from the argument, -p, -f or, if none, from stdin. Stats go to stderr.
    """
    install_notes(choice.verbose)
    prompt = _prompt(prompt, prompt_option, prompt_file)
    screen = Screen(live=False if as_json else None)
    with choice.open() as llm:
        screen.notes()
        first_use(llm)
        use_chat = not raw and llm.target.chat_template() is not None
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            tokens = llm.chat_tokens(messages)
        else:
            tokens = llm.tokenize(prompt)
        bar = PrefillBar(screen.status)
        stream = llm.stream_of(tokens, replace(gen, on_progress=None if as_json else bar))
        legend = ColorLegend(llm.draft.name if llm.draft is not None else "the draft") \
            if color and sys.stdout.isatty() and not as_json else None
        if as_json:
            for _ in stream:
                pass
        else:
            _show(screen, llm, stream, legend)
        result = stream.result
        why_not = why_not_speculating(llm, result.stats)
        if not as_json:
            click.echo()
            screen.notes()
            click.echo(f"[{models_label(llm)}] {result.stats.summary()}, finish: {result.finish_reason}", err=True)
            if legend is not None:
                click.echo(legend.line(), err=True)
            if why_not:
                click.echo(f"speculation off: {why_not}", err=True)
        plain, speedups = None, []
        if compare:  # a second pair in the other order: a ratio's spread on this machine
            if not as_json:
                click.echo("[decoding the same prompt plainly, then both again, to compare ...]", err=True)
            plain = llm.generate(tokens, **{**gen.as_kwargs(), "n_draft": 0})
            plain_again = llm.generate(tokens, **{**gen.as_kwargs(), "n_draft": 0})
            spec_again = llm.generate(tokens, **gen.as_kwargs())
            speedups = [_speedup(result, plain), _speedup(spec_again, plain_again)]
        if as_json:
            out = {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                   "stats": result.stats.as_dict(), "settings": _settings(llm, choice, gen),
                   "models": {"target": llm.target.name, "draft": llm.draft.name if llm.draft else None},
                   "speculation_off_because": why_not}
            if plain is not None:
                out["plain"] = {"stats": plain.stats.as_dict(), "identical": plain.tokens == result.tokens,
                                "speedup": _speedup(result, plain), "speedups": speedups}
            click.echo(json.dumps(out))
        elif plain is not None:
            _print_comparison(result, plain, speedups)


def _show(screen: Screen, llm: Any, stream: Any, legend: Optional[ColorLegend]) -> None:
    """Stream the answer with the live status line, which is gone from the screen afterwards;
    with a legend, in colours that say who chose each token."""
    status = _StatusLine(llm)
    screen.begin()
    try:
        for chunk in stream:
            if legend is not None:
                legend.add(chunk.origins)
            screen.text(chunk.text, style_of(chunk.origins) if legend is not None else "")
            line = status.update(stream, chunk)
            if line:
                screen.status(line)
    finally:
        screen.end()


def models_label(llm: Any) -> str:
    """Who wrote the text: the target, and what drafted for it."""
    if llm.draft is not None:
        return f"{llm.target.name}, drafted by {'its MTP layers' if llm.mtp else llm.draft.name}"
    return f"{llm.target.name}, " + ("drafted by prompt lookup" if llm.lookup else "no draft")


def first_use(llm: Any, alone: bool = True) -> None:
    """A one-shot command is never idle: measure now what its request uses and a server would
    measure between requests (once per model, settings and machine), saying so. Not what only
    requests side by side use (a prefill in pieces: 16 s of the 19 s a first `run` of the Qwen
    pair measured here), which a server or chat measures while idle (alone False: that too)."""
    pending = llm.idle.pending(alone)
    if pending:
        click.echo(f"specllama: first use of {llm.target.name} with these settings here: measuring "
                   f"{', '.join(pending)} (once; cached for later runs)", err=True)
        llm.warm_up(alone=alone)


def _settings(llm: Any, choice: ModelChoice, gen: GenerateOptions) -> dict:
    """What the run was given, as the loaded models report it where they can."""
    given = {k: v for k, v in choice.settings().items() if k != "verbose"}
    return {**given, "n_ctx": llm.target.n_ctx, "n_threads": getattr(llm.target, "n_threads", given.get("n_threads")),
            "n_batch": llm.target.n_batch, "draft": llm.draft.name if llm.draft is not None else None,
            **{k: v for k, v in gen.as_kwargs().items() if k in ("max_tokens", "temperature", "top_k", "top_p",
                                                                  "min_p", "seed", "repeat_penalty", "stop")}}


def _prompt(prompt: Optional[str], prompt_option: Optional[str], prompt_file: Optional[str]) -> str:
    given = [p for p in (prompt, prompt_option) if p is not None]
    if prompt_file is not None:
        given.append(open(prompt_file, encoding="utf-8").read())
    if len(given) > 1:
        raise click.UsageError("give the prompt once: as PROMPT, -p or -f")
    if given:
        return given[0]
    if sys.stdin.isatty():
        raise click.UsageError("give a PROMPT argument, -p, -f, or pipe one on stdin")
    return sys.stdin.read()


def _speedup(spec: Any, plain: Any) -> float:
    rate = plain.stats.decode_tokens_per_second
    return spec.stats.decode_tokens_per_second / rate if rate else 0.0


def _print_comparison(spec: Any, plain: Any, speedups: list[float]) -> None:
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
    low, high = min(speedups), max(speedups)
    noise = " - within this machine's noise" if low <= 1.0 <= high else ""
    click.echo(f"speedup:     {_speedup(spec, plain):.2f}x (two runs each, alternated: {low:.2f}x-{high:.2f}x"
               f"{noise}), {same}", err=True)


def why_not_speculating(llm: Any, stats: Any) -> Optional[str]:
    """One line on why a generation drafted nothing (no draft, a measurement still to come, the
    fidelity level, the cost, the acceptance), or None when it drafted."""
    if stats.n_drafted:
        return None
    if not llm.speculates:
        return "no draft model (--draft auto found none, or --draft none)"
    if stats.measurements_pending:
        return (f"{', '.join(stats.measurements_pending)} not measured yet on this machine: decoding plainly "
                "there until it is (measured when idle, or by `specllama calibrate`)")
    if stats.verify_limits and max(stats.verify_limits.values()) <= 1:
        return (f"the {stats.fidelity} fidelity level allows no verify batch on this backend at this context "
                f"length (--exact off allows drafting; the README's fidelity table says what differs)")
    c = stats.controller
    v = c.get("v_ms", {})
    costs = (f"one token takes {v.get(1)} ms, verifying two {v.get(2)} ms and a draft token "
             f"{c.get('draft_token_ms')} ms here")
    if c.get("kind") == "auto" and not c.get("draft_model"):
        return f"cost: even a draft that is always right would be slower than plain decoding ({costs})" \
            + ("; prompt lookup found nothing to copy" if c.get("lookup") else "")
    if c.get("kind") == "auto":
        return (f"cost at this text's acceptance ({c.get('draft_acceptance', 0):.0%}): every round, plain "
                f"decoding was predicted faster ({costs})")
    return "the fixed draft length is 0 (--n-draft)"


class _StatusLine:
    """A live line on stderr: tokens, speed, acceptance, draft in use."""

    def __init__(self, llm: Any):
        self.draft = llm.draft.name if llm.draft else "no draft"
        self.t_start = time.perf_counter()
        self.n_tokens = 0
        self.n_from_draft = 0
        self.t_last = 0.0

    def update(self, stream: Any, chunk: Any) -> Optional[str]:
        self.n_tokens += len(chunk.tokens)
        self.n_from_draft += sum(chunk.from_draft)
        now = time.perf_counter()
        if now - self.t_last < 0.25:
            return None
        self.t_last = now
        rate = self.n_tokens / max(now - self.t_start, 1e-9)
        share = self.n_from_draft / self.n_tokens if self.n_tokens else 0.0
        stats = stream.stats
        n_ties = len(stats.near_tie_positions) if stats is not None else 0
        ties = f", {n_ties} near-ties" if n_ties else ""
        if stats is not None and stats.n_prompt_cached:
            ties += f", prompt {stats.n_prompt_cached / stats.n_prompt:.0%} cached"
        return f"  {self.n_tokens} tok, {rate:.1f} tok/s, {share:.0%} drafted ({self.draft}){ties}"


@main.command("chat")
@model_options
@click.option("--system", default=None, help="System message that starts the conversation.")
@generation_options
@click.option("--stats", "show_stats", is_flag=True, help="Print each answer's figures after it (stderr).")
@color_option
def chat_cmd(choice: ModelChoice, system: Optional[str], gen: GenerateOptions, show_stats: bool, color: bool) -> None:
    """Chat with MODEL in the terminal; the history and its prompt cache are kept between turns."""
    from .chat import chat_loop

    install_notes(choice.verbose)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    options = {k: v for k, v in gen.as_kwargs().items() if k != "max_tokens" or _given("max_tokens")}
    from ..measuring.idle import idle_wanted

    with choice.open(idle_work=idle_wanted(default=True)) as llm:  # measures while the person types
        if llm.target.chat_template() is None:
            raise click.ClickException(f"{llm.target.name} has no chat template in its GGUF; "
                                       "use `specllama run --raw` with a plain prompt")
        chat_loop(llm, options, system=system, show_stats=show_stats, color=color and sys.stdout.isatty())


def _given(name: str) -> bool:
    """Whether the command line set this option (rather than its default)."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
