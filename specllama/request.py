"""One generation, checked: the prompt and every option resolved against load()'s, as the
planner and the decode loop read them (engine.SpecLlama._request builds it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

from .constraints import Constraint
from .fidelity import Level
from .sampling import SamplingSettings
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
