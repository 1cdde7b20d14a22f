"""llama-cpp-python's completion API on a SpecLlama: the same dict shapes and chunk sequences as
llama_cpp.Llama.create_completion / create_chat_completion (0.3.36), on the one generate path.

A script written for llama_cpp.Llama needs only its constructor line changed. Arguments that
would change how tokens are chosen and that speculative verification cannot reproduce exactly
(grammars, logit biases, penalties, mirostat, logprobs) raise InvalidParameterError naming
the argument, rather than being ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, Optional, Union

from .errors import InvalidParameterError
from .stats import Stats

# llama-cpp-python arguments specllama cannot honour exactly, with the value that means "off"
NEUTRAL = {"suffix": None, "logprobs": None, "echo": False, "frequency_penalty": 0.0, "presence_penalty": 0.0,
           "repeat_penalty": 1.0, "typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0, "grammar": None,
           "logit_bias": None, "logits_processor": None, "stopping_criteria": None, "top_logprobs": None,
           "response_format": None, "tools": None, "functions": None, "tool_choice": None,
           "function_call": None}
IGNORED = {"mirostat_tau", "mirostat_eta", "model", "user", "n", "logit_bias_type"}


def check_supported(options: dict) -> None:
    """Raise for an argument set to a value that would change token choice in a way we cannot
    reproduce exactly; ignore the ones that change nothing (mirostat_tau without mirostat)."""
    for name, value in options.items():
        if name in IGNORED:
            if name == "n" and value not in (None, 1):
                raise InvalidParameterError("n", value, "1: one completion per request")
            continue
        if name not in NEUTRAL:
            raise TypeError(f"unexpected argument {name!r}")
        neutral = NEUTRAL[name]
        if value is not None and value != neutral and not (name == "logprobs" and value is False):
            raise InvalidParameterError(name, value, f"{neutral!r}: specllama cannot apply {name} and keep "
                                                     "speculative output exactly the target's")


class Completion:
    """One request: text or chat, run on the SpecLlama's stream path, as llama-cpp-python dicts.

    Args:
        llm: the SpecLlama.
        tokens: the prompt as token ids (chat messages already rendered).
        chat: shape the output as chat.completion(.chunk) instead of text_completion.
        model: the name in the "model" field.
        generate: options for SpecLlama.stream (max_tokens, temperature, ..., n_draft).
    """

    def __init__(self, llm: Any, tokens: list[int], *, chat: bool, model: str, **generate: Any):
        self.llm, self.tokens, self.chat, self.model = llm, tokens, chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.stream = llm.stream(tokens, **generate)  # checks every option now

    @property
    def stats(self) -> Optional[Stats]:
        return self.stream.result.stats if self.stream.result is not None else None

    def usage(self, details: bool = False) -> dict:
        """llama-cpp-python's usage; details adds OpenAI's prompt_tokens_details (cached tokens)."""
        n = len(self.stream.result.tokens) if self.stream.result is not None else 0
        usage = {"prompt_tokens": len(self.tokens), "completion_tokens": n, "total_tokens": len(self.tokens) + n}
        if details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.stats.n_prompt_cached if self.stats else 0}
        return usage

    def finish_reason(self) -> str:
        reason = self.stream.result.finish_reason
        return "stop" if reason == "stop" else "length"

    def response(self) -> dict:
        """The whole completion (non-streaming)."""
        text = "".join(chunk.text for chunk in self.stream)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason()}
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, **choice}
        else:
            choice = {"text": text, **choice}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def chunks(self) -> Iterator[dict]:
        """Stream chunks; the last one carries finish_reason. Closing the iterator cancels the
        generation at the next round."""
        try:
            if self.chat:
                yield self._chunk({"delta": {"role": "assistant"}}, None)
            for chunk in self.stream:
                if chunk.text:
                    yield self._chunk({"delta": {"content": chunk.text}} if self.chat else {"text": chunk.text}, None)
            yield self._chunk({"delta": {}} if self.chat else {"text": ""}, self.finish_reason())
        finally:
            self.stream.close()

    def _chunk(self, body: dict, finish_reason: Optional[str]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [{**({"index": 0} if self.chat else {}), **body,
                             **({} if self.chat else {"index": 0}), "logprobs": None,
                             "finish_reason": finish_reason}]}


def timings(stats: Stats) -> dict:
    """llama.cpp server-style timings of a finished generation."""
    predicted_ms = stats.t_decode * 1000
    n_predicted = max(0, stats.n_generated - 1)
    # as llama-server: cache_n prompt tokens reused, prompt_n the ones decoded
    return {"cache_n": stats.n_prompt_cached, "prompt_n": stats.n_prompt - stats.n_prompt_cached,
            "prompt_ms": stats.t_prefill * 1000, "predicted_n": stats.n_generated,
            "predicted_ms": predicted_ms,
            "predicted_per_second": n_predicted / stats.t_decode if stats.t_decode > 0 else 0.0,
            "draft_n": stats.n_drafted, "draft_n_accepted": stats.n_accepted, "near_ties": stats.near_ties,
            "fidelity": stats.fidelity}


def generate_options(max_tokens: Optional[int], n_tokens: int, n_ctx: int, *, temperature: float, top_p: float,
                     min_p: float, top_k: int, stop: Union[None, str, list[str]], seed: Optional[int],
                     n_draft: Union[None, int, str] = None, speculative: bool = True) -> dict:
    """SpecLlama.stream options from llama-cpp-python's arguments (max_tokens None or <= 0:
    as many as the context holds)."""
    if max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens <= 0):
        max_tokens = max(1, n_ctx - n_tokens)
    options = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                   stop=stop or None, seed=seed)
    if not speculative:
        options["n_draft"] = 0
    elif n_draft is not None:
        options["n_draft"] = n_draft
    return options
