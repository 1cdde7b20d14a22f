"""Every option the commands share, declared once: what to load and how (ModelChoice), and how
to generate (GenerateOptions). Each accepts llama.cpp's spelling too (-m, -md, -c, -ngl, -n,
...), and everything is checked before a model loads."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import click

from ..errors import InvalidParameterError, SpecLlamaError
from ..measuring.fidelity import parse_level
from ..options import GenerateOptions

_GEN = {f.name: f.default for f in dataclasses.fields(GenerateOptions)}


class _Exact(click.ParamType):
    name = "bitwise|rounding|off|LOGITS"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        level = float(value) if _is_number(value) else value
        try:
            parse_level(level)
        except SpecLlamaError:
            self.fail(f"{value!r} is not bitwise, rounding, off or a bound in logits >= 0", param, ctx)
        return level


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Opt:
    dest: str
    names: tuple[str, ...]
    kw: dict


# what to load and how: load()'s arguments and ModelSettings' fields, for every model command
MODEL_OPTIONS = [
    Opt("draft", ("--draft", "-md", "--model-draft"), dict(
        default="auto", envvar="SPECLLAMA_DRAFT", show_default=True,
        help="Draft: auto, none, ngram (prompt lookup), mtp (the target's own MTP layers), or a .gguf path / "
             "repo id / alias.")),
    Opt("n_draft", ("--n-draft", "--draft-max"), dict(default=None, help="Tokens drafted per round, or auto.")),
    Opt("n_ctx", ("--ctx", "-c", "--ctx-size"), dict(type=click.IntRange(min=0), default=4096, show_default=True,
                                                     help="Context size in tokens (0: the model's trained context).")),
    Opt("n_threads", ("--threads", "-t"), dict(type=click.IntRange(min=1), default=None,
                                               help="CPU threads (default: the CPUs this process may use).")),
    Opt("n_gpu_layers", ("--gpu-layers", "-ngl", "--n-gpu-layers"), dict(
        type=click.IntRange(min=-1), default=-1, show_default=True,
        help="Target layers to offload to Metal/CUDA (-1 = all).")),
    Opt("draft_n_gpu_layers", ("--draft-gpu-layers", "-ngld", "--n-gpu-layers-draft"), dict(
        type=click.IntRange(min=-1), default=None, help="Draft layers to offload (default: as --gpu-layers).")),
    Opt("exact", ("--exact",), dict(type=_Exact(), default="rounding", show_default=True,
                                    help="Fidelity: bitwise = token for token the target alone at any length; "
                                         "rounding = verify batches that differ by float rounding only (near-ties "
                                         "counted); off = no limit; a number = that many logits.")),
    Opt("inexact", ("--inexact",), dict(is_flag=True, hidden=True, help="Same as --exact off.")),
    Opt("flash_attn", ("--flash-attn", "-fa"), dict(type=click.Choice(["on", "off", "auto"]), default="auto",
                                                     show_default=True, help="Flash attention.")),
    Opt("type_k", ("--cache-type-k", "-ctk"), dict(default=None, help="KV cache type for K (f16, q8_0, ...).")),
    Opt("type_v", ("--cache-type-v", "-ctv"), dict(default=None, help="KV cache type for V (needs flash attention "
                                                                       "unless f16).")),
    Opt("rpc", ("--rpc",), dict(default=None, envvar="SPECLLAMA_RPC_WORKERS",
                                help="host:port,... of llama.cpp RPC workers (specllama worker) that hold the "
                                     "target's offloaded layers; the draft stays on this machine.")),
    Opt("tensor_split", ("--tensor-split", "-ts"), dict(
        default=None, help="Share of the offloaded layers per device, e.g. 3,1 (default: by free memory).")),
    Opt("draft_rpc", ("--draft-rpc",), dict(default=None, help="RPC workers for the draft too (default: none).")),
    Opt("prompt_cache_mb", ("--prompt-cache-mb",), dict(
        type=click.FloatRange(min=0), default=1024, show_default=True, envvar="SPECLLAMA_PROMPT_CACHE_MB",
        help="RAM for saved prompt-cache states of conversations switched away from (0: only the live one).")),
    Opt("prompt_cache_dir", ("--prompt-cache-dir",), dict(
        type=click.Path(file_okay=False), default=None, envvar="SPECLLAMA_PROMPT_CACHE_DIR",
        help="Keep prompt-cache states in this folder across restarts (off unless set): long prompts, "
             "states RAM evicts and the conversation at exit, keyed to the model files, build and settings.")),
    Opt("prompt_cache_disk_mb", ("--prompt-cache-disk-mb",), dict(
        type=click.FloatRange(min=0, min_open=True), default=10240, show_default=True,
        envvar="SPECLLAMA_PROMPT_CACHE_DISK_MB", help="Disk budget of --prompt-cache-dir; least recently used out.")),
    Opt("verbose", ("--verbose", "-v"), dict(is_flag=True, help="Show llama.cpp logs and full tracebacks.")),
]

# how to generate: GenerateOptions' fields, their defaults taken from it
GENERATION_OPTIONS = [
    Opt("max_tokens", ("--max-tokens", "-n", "--n-predict"), dict(
        type=int, default=_GEN["max_tokens"], show_default=True,
        help="Most tokens to generate (-1: until the text ends or the context is full).")),
    Opt("temperature", ("--temp", "--temperature"), dict(type=float, default=_GEN["temperature"], show_default=True,
                                                         help="0 = greedy.")),
    Opt("top_k", ("--top-k",), dict(type=int, default=_GEN["top_k"], show_default=True)),
    Opt("top_p", ("--top-p",), dict(type=float, default=_GEN["top_p"], show_default=True)),
    Opt("min_p", ("--min-p",), dict(type=float, default=_GEN["min_p"], show_default=True)),
    Opt("seed", ("--seed", "-s"), dict(type=int, default=None, help="Seed for sampling (same seed, same text).")),
    Opt("stop", ("--stop",), dict(multiple=True, help="Stop string (repeatable); not included in the output.")),
    Opt("repeat_penalty", ("--repeat-penalty",), dict(type=float, default=_GEN["repeat_penalty"],
                                                      show_default=True, help="1 = off.")),
    Opt("frequency_penalty", ("--frequency-penalty",), dict(type=float, default=_GEN["frequency_penalty"])),
    Opt("presence_penalty", ("--presence-penalty",), dict(type=float, default=_GEN["presence_penalty"])),
    Opt("grammar", ("--grammar",), dict(default=None, help="A GBNF grammar the output must match.")),
    Opt("grammar_file", ("--grammar-file",), dict(type=click.Path(exists=True, dir_okay=False), default=None,
                                                  help="A file holding a GBNF grammar.")),
    Opt("json_schema", ("--json-schema", "-j"), dict(default=None, help="A JSON schema the output must match "
                                                                         "(JSON text, or @FILE).")),
]


@dataclass
class ModelChoice:
    """The model a command was asked to load, with its options. resolve() finds the files once."""

    model: str
    draft: str = "auto"
    n_draft: Optional[str] = None
    n_ctx: int = 4096
    n_threads: Optional[int] = None
    n_gpu_layers: int = -1
    draft_n_gpu_layers: Optional[int] = None
    exact: Any = "rounding"
    inexact: bool = False
    flash_attn: str = "auto"
    type_k: Optional[str] = None
    type_v: Optional[str] = None
    rpc: Optional[str] = None
    tensor_split: Optional[str] = None
    draft_rpc: Optional[str] = None
    prompt_cache_mb: float = 1024
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_mb: float = 10240
    verbose: bool = False
    _resolved: Optional[tuple[Path, Any, list[str]]] = None

    def resolve(self) -> tuple[Path, Any]:
        """(target path, draft path, MTP or None), resolved once; the notes go to stderr."""
        if self._resolved is None:
            from ..models.draft_select import resolve_pair

            target, draft, notes = resolve_pair(self.model, None if self.draft in ("ngram", "none") else self.draft)
            for note in notes:
                click.echo(note, err=True)
            self._resolved = (Path(target), draft, notes)
        return self._resolved[0], self._resolved[1]

    def settings(self) -> dict:
        """ModelSettings fields for load() (the draft's prefixed draft_)."""
        target, _ = self.resolve()
        trained = trained_context(target)
        n_ctx = self.n_ctx or trained or 4096
        if trained and n_ctx > trained:
            click.echo(f"warning: --ctx {n_ctx} is past the {trained} tokens {target.name} was trained on; "
                       "output degrades past that (--ctx 0 takes the trained length)", err=True)
        settings: dict[str, Any] = dict(n_ctx=n_ctx, n_threads=self.n_threads, n_gpu_layers=self.n_gpu_layers,
                                        verbose=self.verbose, type_k=self.type_k, type_v=self.type_v,
                                        flash_attn={"on": True, "off": False, "auto": None}[self.flash_attn])
        if self.draft_n_gpu_layers is not None:
            settings["draft_n_gpu_layers"] = self.draft_n_gpu_layers
        for key, value in (("rpc", self.rpc), ("tensor_split", self.tensor_split), ("draft_rpc", self.draft_rpc)):
            if value:
                settings[key] = value
        return settings

    def open(self, **load_options: Any) -> Any:
        """The loaded SpecLlama (load_options: load()'s, beside the command line's)."""
        from ..loader import load

        target, draft = self.resolve()
        if isinstance(draft, Path) or (isinstance(draft, str) and draft.endswith(".gguf")):
            n_target, n_draft = target.stat().st_size, Path(draft).stat().st_size
            if n_draft > n_target:
                click.echo(f"warning: the draft {Path(draft).name} ({n_draft / 2**30:.2f} GiB) is larger than the "
                           f"target {target.name} ({n_target / 2**30:.2f} GiB): are MODEL and --draft swapped?",
                           err=True)
        kwargs: dict[str, Any] = {}
        if self.n_draft is not None:
            kwargs["n_draft"] = self.n_draft if self.n_draft == "auto" else _int_option("--n-draft", self.n_draft)
        return load(target, "ngram" if self.draft == "ngram" else draft, exact="off" if self.inexact else self.exact,
                    prompt_cache_mb=self.prompt_cache_mb, prompt_cache_dir=self.prompt_cache_dir,
                    prompt_cache_disk_mb=self.prompt_cache_disk_mb, **kwargs, **load_options, **self.settings())


def trained_context(path: Path) -> Optional[int]:
    """The context length the model was trained on, from its GGUF header."""
    from ..models import gguf_check

    fields = gguf_check.read_header(path).fields
    value = fields.get(f"{fields.get('general.architecture')}.context_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def _int_option(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise click.BadParameter(f"{value!r} is not an integer or auto", param_hint=name) from None


def _add(options: list[Opt], f: Callable) -> Callable:
    for opt in reversed(options):
        f = click.option(*opt.names, opt.dest, **opt.kw)(f)
    return f


def model_options(f: Optional[Callable] = None, *, required: bool = True) -> Any:
    """MODEL (or -m/--model) and MODEL_OPTIONS, given to the command as choice: ModelChoice
    (None when not required and no model is named)."""
    if f is None:
        return functools.partial(model_options, required=required)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        option, positional = kwargs.pop("model_option"), kwargs.pop("model")
        if option and positional:
            if kwargs.get("prompt", "") is None:  # `run -m MODEL "prompt"`: the word is the prompt
                kwargs["prompt"] = positional
            else:
                raise click.UsageError(f"two models named: {positional!r} and -m {option!r}")
        model = option or positional
        values = {o.dest: kwargs.pop(o.dest) for o in MODEL_OPTIONS}
        click.get_current_context().meta["specllama.verbose"] = values["verbose"]
        if not model and required:
            raise click.UsageError("name a MODEL (a .gguf path, repo id or alias), or -m MODEL")
        return f(*args, choice=ModelChoice(model, **values) if model else None, **kwargs)

    wrapped = _add(MODEL_OPTIONS, wrapper)
    wrapped = click.option("-m", "--model", "model_option", default=None, help="The model (instead of MODEL).")(wrapped)
    return click.argument("model", required=False, envvar="SPECLLAMA_MODEL")(wrapped)


def generation_options(f: Callable) -> Callable:
    """GENERATION_OPTIONS, checked into gen: GenerateOptions before anything loads."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {o.dest: kwargs.pop(o.dest) for o in GENERATION_OPTIONS}
        return f(*args, gen=build_generation(values), **kwargs)

    return _add(GENERATION_OPTIONS, wrapper)


def build_generation(values: dict) -> GenerateOptions:
    """GenerateOptions from the command line's values: a grammar file read, a schema parsed."""
    grammar_file, schema = values.pop("grammar_file", None), values.get("json_schema")
    if grammar_file is not None:
        if values.get("grammar"):
            raise click.BadParameter("give --grammar or --grammar-file, not both", param_hint="--grammar-file")
        values["grammar"] = Path(grammar_file).read_text(encoding="utf-8")
    if isinstance(schema, str):
        text = Path(schema[1:]).read_text(encoding="utf-8") if schema.startswith("@") else schema
        try:
            values["json_schema"] = json.loads(text)
        except ValueError as e:
            raise click.BadParameter(f"not a JSON schema: {e}", param_hint="--json-schema") from None
    values["stop"] = list(values.get("stop") or ())
    if isinstance(values.get("max_tokens"), int) and values["max_tokens"] < 0:
        values["max_tokens"] = None  # llama.cpp's -n -1: until the text ends or the context is full
    try:
        return GenerateOptions.of(values)
    except InvalidParameterError as e:  # named as the command line spells it
        flag = next((o.names[0] for o in GENERATION_OPTIONS if o.dest == e.name), e.name)
        raise click.BadParameter(f"{e.value!r}: it must be {e.allowed}", param_hint=flag) from None


def color_option(f: Callable) -> Callable:
    """--color: the answer in colours saying who chose each token (a terminal only)."""
    return click.option("--color", "--colour", "color", is_flag=True,
                        help="Colour the answer by who chose each token: green, drafted by the draft model and "
                             "kept by the target; cyan, copied by prompt lookup and kept; plain, the target's "
                             "own. Off when stdout is not a terminal.")(f)


def plot_option(f: Callable) -> Callable:
    """--plot FILE.png, checked (matplotlib there, a .png name) before anything loads."""
    def check(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[Path]:
        if value is None:
            return None
        from ..plots import missing

        problem = missing()
        if problem is not None:
            raise click.BadParameter(problem, ctx=ctx, param=param)
        if not value.lower().endswith(".png"):
            raise click.BadParameter(f"{value!r}: give a file name ending in .png", ctx=ctx, param=param)
        return Path(value)

    return click.option("--plot", type=click.Path(dir_okay=False, writable=True), default=None, callback=check,
                        metavar="FILE.png", help="Draw the decode-cost curve, the acceptance by draft position and "
                        "the speed against draft length to FILE.png (matplotlib: pip install -e '.[plot]').")(f)
