"""One generation, checked: the prompt and every option resolved against load()'s, as the
planner and the decode loop read them (resolve() builds it from GenerateOptions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from .decoding.constraints import Constraint, Grammar, Penalties, check_logit_bias, grammar_source
from .errors import InvalidParameterError
from .measuring.fidelity import Level, parse_level
from .options import GenerateOptions, check_n_draft, check_tree
from .runtime.protocols import Model
from .decoding.sampling import SamplingSettings
from .streams import PromptProgress


@dataclass(frozen=True)
class Request:
    """One generation, checked: the prompt and the options resolved against load()'s."""

    prompt: list[int]
    sampling: SamplingSettings
    max_tokens: int
    seed: Optional[int]
    stop: tuple[str, ...]
    n_draft: Union[int, str]
    level: Level
    constraint: Optional[Constraint] = None  # this request's own: its state follows the text
    n_logprobs: Optional[int] = None
    tree: Union[int, str] = "auto"
    cache_scope: str = ""  # whose prompt-cache states this generation may reuse
    on_progress: Optional[Callable[[PromptProgress], None]] = None  # told how the prefill goes

    @property
    def seeded(self) -> bool:
        """Sampling with a seed: the same seed must give the same text, whatever ran before."""
        return self.seed is not None and not self.sampling.greedy

    @property
    def canonical(self) -> bool:
        """The target's prompt cache may reuse only what a fresh prefill computes bit for bit:
        bitwise output, or a seed that must give the same text whatever ran before."""
        return self.level.bound == 0 or self.seeded


@dataclass(frozen=True)
class Defaults:
    """What load() set that a generation's options may override."""

    n_draft: Union[int, str]
    level: Level
    tree: Union[int, str]


def resolve(prompt: list[int], o: GenerateOptions, target: Model, defaults: Defaults) -> Request:
    """The Request for a checked prompt and options on this target: load()'s values where the
    options leave them out, the grammar compiled, max_tokens=None made the context's room."""
    sampling = SamplingSettings(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p)
    constraint = _constraint(target, o.grammar, o.json_schema, o.logit_bias,
                             Penalties(o.repeat_penalty, o.frequency_penalty, o.presence_penalty, o.penalty_last_n))
    # None: the most the context holds (every token decoded into it, and one more sampled after)
    max_tokens = target.n_ctx - len(prompt) + 1 if o.max_tokens is None else o.max_tokens
    return Request(prompt, sampling, max_tokens, o.seed, tuple(o.stop or ()),
                   defaults.n_draft if o.n_draft is None else check_n_draft(o.n_draft),
                   defaults.level if o.exact is None else parse_level(o.exact), constraint, o.logprobs,
                   defaults.tree if o.tree is None else tree_for(target, o.tree), o.cache_scope, o.on_progress)


def tree_for(target: Model, tree: Any) -> Union[int, str]:
    """check_tree, refusing more than one candidate a position where the target verifies chains only."""
    tree = check_tree(tree)
    if isinstance(tree, int) and tree > 1 and target.n_branches <= 1:
        why = "MTP layers" if target.mtp_head is not None else \
            f"{target.memory} memory, or a model this process does not host"
        raise InvalidParameterError("tree", tree, f'1 or "auto": {target.name} verifies chains only ({why})')
    return tree


def _constraint(target: Model, grammar: Any, json_schema: Any, logit_bias: Optional[dict],
                penalties: Penalties) -> Optional[Constraint]:
    source = grammar_source(grammar, json_schema)
    parsed = None
    if source is not None:
        param = "grammar" if grammar is not None else "json_schema"
        parsed = Grammar(target.grammar_tokenizer(), source, param)
    constraint = Constraint(logit_bias=check_logit_bias(logit_bias, target.n_vocab), penalties=penalties,
                            grammar=parsed)
    return constraint if constraint.active else None
