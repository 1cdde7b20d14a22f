"""llama-cpp-python's completion API on a SpecLlama: the same dict shapes and chunk sequences as
llama_cpp.Llama.create_completion / create_chat_completion (0.3.36), on the one generate path.

A script written for llama_cpp.Llama needs only its constructor line changed. Grammars,
response_format, tools, logit biases, penalties and logprobs are applied in verification (see
constraints.py); the few arguments still not supported raise InvalidParameterError naming the
argument and why, rather than being ignored.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any, Optional, Protocol, Union

from ..decoding.constraints import Lark
from ..errors import InvalidParameterError
from ..options import GenerateOptions, Prompt
from ..runtime.protocols import Model
from ..decoding.stats import Stats
from ..streams import Stream
from .tools import ToolFormat, check_tools, chosen_tools, detect



class Generator(Protocol):
    """What a completion needs of the object it runs on (engine.SpecLlama)."""

    @property
    def target(self) -> Model: ...

    def stream_of(self, prompt: Prompt, options: GenerateOptions) -> Stream: ...

    def chat_tokens(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]: ...

# llama-cpp-python arguments specllama does not apply yet: the value that means "off", and why
NEUTRAL = {"echo": (False, "echoing the prompt (with its logprobs) is not built yet"),
           "typical_p": (1.0, "locally typical sampling is not among specllama's samplers yet"),
           "tfs_z": (1.0, "tail-free sampling was removed from llama.cpp"),
           "mirostat_mode": (0, "mirostat's state follows each sampled token's surprise; not built yet"),
           "logits_processor": (None, "Python logits processors see llama-cpp-python's whole score "
                                      "array; use grammar, logit_bias or the penalties"),
           "stopping_criteria": (None, "use stop strings"),
           "functions": (None, "the legacy functions API: send tools instead"),
           "function_call": (None, "the legacy functions API: send tool_choice instead")}
IGNORED = {"mirostat_tau", "mirostat_eta", "model", "user", "n", "logit_bias_type"}


def check_supported(options: dict) -> None:
    """Raise for an argument set to a value specllama does not apply; ignore the ones that
    change nothing (mirostat_tau without mirostat)."""
    for name, value in options.items():
        if name in IGNORED:
            if name == "n" and value not in (None, 1):
                raise InvalidParameterError("n", value, "1: one completion per request")
            continue
        if name not in NEUTRAL:
            raise TypeError(f"unexpected argument {name!r}")
        neutral, why = NEUTRAL[name]
        if value is not None and value != neutral:
            raise InvalidParameterError(name, value, f"{neutral!r} ({why})")


def response_schema(response_format: Any) -> Any:
    """The JSON schema a response_format asks for, or None for free text.

    {"type": "json_object"} (optionally with llama-cpp-python's "schema"): any JSON object;
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}: that schema.
    """
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return response_format.get("schema") or {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
            return spec.get("schema") or {"type": "object"}
    raise InvalidParameterError("response_format", response_format,
                                '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                                '"json_schema": {"name": ..., "schema": {...}}}')


def shaping_options(*, grammar: Any = None, response_format: Any = None, logit_bias: Any = None,
                    repeat_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                    logprobs: Optional[int] = None) -> dict:
    """SpecLlama.stream options for what shapes the rows (llama-cpp-python's names)."""
    schema = response_schema(response_format)
    if schema is not None and grammar is not None:
        raise InvalidParameterError("response_format", response_format, "left out when a grammar is given")
    return dict(grammar=grammar, json_schema=schema, logit_bias=logit_bias, repeat_penalty=repeat_penalty,
                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, logprobs=logprobs)


def chat_logprobs(logprobs: Any, top_logprobs: Any) -> Optional[int]:
    """The n_logprobs a chat request asks for (logprobs: bool, top_logprobs: 0..20)."""
    if top_logprobs is not None and not logprobs:
        raise InvalidParameterError("top_logprobs", top_logprobs, "given only with logprobs=true")
    if not logprobs:
        return None
    return 0 if top_logprobs is None else top_logprobs


def tool_setup(llm: Generator, messages: list[dict], tools: Any, tool_choice: Any, parallel_tool_calls: Any,
               grammar: Any) -> tuple[list[int], Optional[ToolFormat], Any]:
    """(prompt tokens, the format to parse calls from, the grammar to generate under) for a chat
    request with tools: rendered by the GGUF's own template; tool_choice "required" or a named
    function becomes a grammar of calls, so a valid call is guaranteed."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidParameterError("tool_choice", tool_choice, "given only with tools")
        return llm.chat_tokens(messages), None, grammar
    mode, allowed = chosen_tools(check_tools(tools), tool_choice)
    if mode == "none":
        return llm.chat_tokens(messages), None, grammar
    fmt = detect(llm.target.chat_template())
    if fmt is not None:
        fmt = dataclasses.replace(fmt, names=tuple(t["function"]["name"] for t in allowed))
    if fmt is None:
        raise InvalidParameterError("tools", [t["function"]["name"] for t in tools],
                                    f"used with a model whose chat template renders tools; the template in "
                                    f"{llm.target.name} does not, so the model would never see them")
    tokens = llm.chat_tokens(messages, tools=tools)
    if mode == "required":
        if grammar is not None:
            raise InvalidParameterError("grammar", "...", "left out when tool_choice requires a call")
        # one call unless parallel calls are asked for, as llama.cpp's server (small models
        # otherwise tend to repeat the call until max_tokens)
        grammar = Lark(fmt.grammar(allowed, parallel_tool_calls is True, lambda text: _special(llm, text)))
    return tokens, fmt, grammar


def _special(llm: Generator, text: str) -> Optional[int]:
    if not text:
        return None
    ids = llm.target.tokenize(text, add_special=False, parse_special=True)
    # a grammar names special tokens by id; their text alone would not match them
    return ids[0] if len(ids) == 1 and llm.target.grammar_tokenizer().is_special_token(ids[0]) else None


class Completion:
    """One request: text or chat, run on the SpecLlama's stream path, as llama-cpp-python dicts.

    Args:
        llm: the SpecLlama.
        tokens: the prompt as token ids (chat messages already rendered).
        chat: shape the output as chat.completion(.chunk) instead of text_completion.
        model: the name in the "model" field.
        tool_format: parse tool calls from the output in this format (chat with tools).
        origins: each streamed chunk's choice says who chose its tokens (Chunk.origins), for a
            UI that colours them (the request's "color": true).
        options: how to generate (generate_options builds them from an API's fields).
    """

    def __init__(self, llm: Generator, tokens: list[int], options: GenerateOptions, *, chat: bool, model: str,
                 tool_format: Optional[ToolFormat] = None, index: int = 0, id: Optional[str] = None,
                 origins: bool = False):
        self.llm, self.tokens, self.chat, self.model = llm, tokens, chat, model
        self.origins = origins
        self.tool_format = tool_format
        self.index = index  # the choice this is, of a request that asked for several
        self.id = id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.n_logprobs = options.logprobs
        self.stream = llm.stream_of(tokens, options)  # checks what needs the model now
        self.tool_calls: list[dict] = []
        self._n_text = 0  # characters of text so far, for completions' text_offset

    @property
    def stats(self) -> Optional[Stats]:
        return self.stream.result.stats if self.stream.result is not None else None

    def usage(self, details: bool = False) -> dict:
        """llama-cpp-python's usage; details adds OpenAI's prompt_tokens_details (cached tokens)."""
        n = len(self.stream.result.tokens) if self.stream.result is not None else 0
        usage: dict[str, Any] = {"prompt_tokens": len(self.tokens), "completion_tokens": n,
                                 "total_tokens": len(self.tokens) + n}
        if details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.stats.n_prompt_cached if self.stats else 0}
        return usage

    def finish_reason(self) -> str:
        if self.tool_calls:
            return "tool_calls"
        result = self.stream.result
        return "stop" if result is not None and result.finish_reason == "stop" else "length"

    def response(self) -> dict:
        """The whole completion (non-streaming)."""
        chunks = list(self.stream)
        text = "".join(chunk.text for chunk in chunks)
        logprobs = self._logprobs(chunks)
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tool_format is not None:
                content, self.tool_calls = self.tool_format.parse(text)
                if self.tool_calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": self.tool_calls}
            choice = {"index": self.index, "message": message, **choice}
        else:
            choice = {"text": text, **choice}
        choice["finish_reason"] = self.finish_reason()
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def chunks(self) -> Iterator[dict]:
        """Stream chunks; the last one carries finish_reason. Closing the iterator cancels the
        generation at the next round. With tools, text that is or may become a call is held
        back, and a call is sent whole as one delta.tool_calls entry once it has ended."""
        held = ""  # chat with tools: text that may be a call
        try:
            if self.chat:
                yield self._chunk({"delta": {"role": "assistant"}}, None)
            for chunk in self.stream:
                logprobs = self._logprobs([chunk])
                if self.tool_format is not None:
                    held += chunk.text
                    n_hold = self.tool_format.holds(held)
                    text, held = held[:len(held) - n_hold], held[len(held) - n_hold:]
                else:
                    text = chunk.text
                if text or logprobs is not None:
                    body: dict[str, Any] = {"delta": {"content": text}} if self.chat else {"text": text}
                    if self.origins and self.tool_format is None:
                        body["origins"] = chunk.origins
                    yield self._chunk(body, None, logprobs)
            if held:
                assert self.tool_format is not None  # only a tool format holds text back
                content, self.tool_calls = self.tool_format.parse(held)
                if content or not self.tool_calls:
                    yield self._chunk({"delta": {"content": content if self.tool_calls else held}}, None)
                if self.tool_calls:
                    yield self._chunk({"delta": {"tool_calls": [{"index": i, **call}
                                                               for i, call in enumerate(self.tool_calls)]}}, None)
            yield self._chunk({"delta": {}} if self.chat else {"text": ""}, self.finish_reason())
        finally:
            self.stream.close()

    def _chunk(self, body: dict, finish_reason: Optional[str], logprobs: Optional[dict] = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [{**({"index": self.index} if self.chat else {}), **body,
                             **({} if self.chat else {"index": self.index}), "logprobs": logprobs,
                             "finish_reason": finish_reason}]}

    def _logprobs(self, chunks: list) -> Optional[dict]:
        """OpenAI's logprobs of these chunks' tokens: chat's {"content": [...]}, or the
        completions' {"tokens", "text_offset", "token_logprobs", "top_logprobs"}."""
        if self.n_logprobs is None:
            return None
        target = self.llm.target
        text = lambda t: target.piece(t).decode("utf-8", errors="replace")  # noqa: E731
        entries = [(token, lp) for chunk in chunks for token, lp in zip(chunk.tokens, chunk.logprobs or [])]
        if self.chat:
            return {"content": [{"token": text(token), "logprob": logprob, "bytes": list(target.piece(token)),
                                 "top_logprobs": [{"token": text(t), "logprob": p, "bytes": list(target.piece(t))}
                                                  for t, p in top]}
                                for token, (logprob, top) in entries]}
        out: dict[str, list] = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        for token, (logprob, top) in entries:
            piece = text(token)
            out["tokens"].append(piece)
            out["text_offset"].append(self._n_text)
            self._n_text += len(piece)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append({text(t): p for t, p in top})
        return out


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
                     n_draft: Union[None, int, str] = None, speculative: bool = True,
                     **shaping: Any) -> GenerateOptions:
    """The options of a generation from llama-cpp-python's arguments (max_tokens None or <= 0:
    as many as the context holds), checked now; shaping: shaping_options()."""
    if max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens <= 0):
        max_tokens = max(1, n_ctx - n_tokens)
    options = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                   stop=stop or None, seed=seed, **shaping)
    if not speculative:
        options["n_draft"] = 0
    elif n_draft is not None:
        options["n_draft"] = n_draft
    return GenerateOptions.of(options)
