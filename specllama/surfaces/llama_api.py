"""llama_cpp.Llama's completion methods on a SpecLlama: the same defaults, dict shapes and chunk
sequences as llama-cpp-python 0.3.36 (completions.py), on the one generate path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from .completions import (Completion, chat_logprobs, check_supported, generate_options, shaping_options,
                          tool_setup)
from ..errors import InvalidParameterError
from .fim import fim_prompt

if TYPE_CHECKING:
    from ..options import Prompt
    from ..streams import Stream


class LlamaApi:
    """create_completion, __call__ and create_chat_completion, as llama_cpp.Llama has them."""

    # what the SpecLlama it is part of provides (completions.Generator, and the prompt's check)
    target: Any
    prompt_tokens: "Callable[[Prompt], list[int]]"
    stream_of: "Callable[..., Stream]"
    chat_tokens: Callable[..., list[int]]

    def create_completion(self, prompt: "Prompt", max_tokens: Optional[int] = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, stop: Union[None, str, list[str]] = None,
                          top_k: int = 40, stream: bool = False, seed: Optional[int] = None,
                          logprobs: Optional[int] = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, grammar: Any = None,
                          logit_bias: Optional[dict] = None, n_draft: Union[None, int, str] = None,
                          suffix: Optional[str] = None, **unsupported: Any) -> Any:
        """llama_cpp.Llama.create_completion: a text_completion dict, or its chunks if stream.

        Same defaults and shapes as llama-cpp-python 0.3.36; n_draft is specllama's own. The
        grammar (GBNF text or a LlamaGrammar), logit_bias, penalties and logprobs are applied
        in verification; suffix makes it fill in the middle between prompt and suffix (the
        GGUF's FIM tokens). echo, typical_p, mirostat and logits processors raise
        InvalidParameterError.
        """
        check_supported(unsupported)
        if suffix is not None:
            if not isinstance(prompt, str) or not isinstance(suffix, str):
                raise InvalidParameterError("suffix", suffix, "text, with a text prompt (fill in the middle)")
            prompt = self.fim_tokens(prompt, suffix, n_predict=max_tokens or 128)
        tokens = self.prompt_tokens(prompt)
        shaping = shaping_options(grammar=grammar, logit_bias=logit_bias, repeat_penalty=repeat_penalty,
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                  logprobs=logprobs)
        return self._complete(tokens, False, max_tokens, stream, None, temperature=temperature, top_p=top_p,
                              min_p=min_p, top_k=top_k, stop=stop, seed=seed, n_draft=n_draft, **shaping)

    __call__ = create_completion

    def create_chat_completion(self, messages: list[dict], max_tokens: Optional[int] = None,
                               temperature: float = 0.2, top_p: float = 0.95, min_p: float = 0.05,
                               stop: Union[None, str, list[str]] = None, top_k: int = 40, stream: bool = False,
                               seed: Optional[int] = None, tools: Optional[list[dict]] = None,
                               tool_choice: Any = None, parallel_tool_calls: Optional[bool] = None,
                               response_format: Optional[dict] = None, logprobs: Optional[bool] = None,
                               top_logprobs: Optional[int] = None, frequency_penalty: float = 0.0,
                               presence_penalty: float = 0.0, repeat_penalty: float = 1.0, grammar: Any = None,
                               logit_bias: Optional[dict] = None, n_draft: Union[None, int, str] = None,
                               **unsupported: Any) -> Any:
        """llama_cpp.Llama.create_chat_completion with the GGUF's chat template: a
        chat.completion dict, or chat.completion.chunk dicts if stream.

        tools are rendered by the template and calls parsed into tool_calls (finish_reason
        "tool_calls"); tool_choice "required" or a named function constrains the output to a
        valid call. response_format, grammar, logit_bias, penalties and logprobs apply in
        verification, so greedy output is plain decoding's under the same constraint.
        """
        check_supported(unsupported)
        tokens, tool_format, grammar = tool_setup(self, messages, tools, tool_choice, parallel_tool_calls, grammar)
        shaping = shaping_options(grammar=grammar, response_format=response_format, logit_bias=logit_bias,
                                  repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty, logprobs=chat_logprobs(logprobs, top_logprobs))
        return self._complete(tokens, True, max_tokens, stream, tool_format, temperature=temperature,
                              top_p=top_p, min_p=min_p, top_k=top_k, stop=stop, seed=seed, n_draft=n_draft, **shaping)

    def fim_tokens(self, prefix: str, suffix: str, *, prompt: str = "", extra: Sequence[dict] = (),
                   n_predict: int = 128) -> list[int]:
        """The fill-in-the-middle prompt between prefix and suffix (fim.fim_prompt): other files
        in extra ({"filename", "text"}), prompt after the prefix. InvalidParameterError for a
        model whose GGUF has no FIM tokens."""
        target = self.target
        return fim_prompt(lambda text: target.tokenize(text, add_special=False), target.fim_tokens(), prefix,
                          suffix, prompt=prompt, extra=extra, n_batch=target.n_batch, n_ctx=target.n_ctx,
                          n_predict=n_predict, bos=target.bos if target.add_bos else None)

    def _complete(self, tokens: list[int], chat: bool, max_tokens: Optional[int], stream: bool,
                  tool_format: Any, **options: Any) -> Any:
        completion = Completion(self, tokens, generate_options(max_tokens, len(tokens), self.target.n_ctx, **options),
                                chat=chat, model=self.target.name, tool_format=tool_format)
        return completion.chunks() if stream else completion.response()
