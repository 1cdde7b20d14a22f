"""A model's vocabulary and chat template: tokenizing, token pieces, special tokens, templates."""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, Optional, Union, cast

import llama_cpp

from ..errors import DecodeError, InvalidParameterError
from .handles import Handle


class Vocab:
    """The vocabulary and facts of a loaded model (a Runtime is one, over its own model)."""

    name: str

    def __init__(self, model: Handle):
        self._model_handle = model
        self._vocab = llama_cpp.llama_model_get_vocab(model.ptr)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._pieces: dict[int, bytes] = {}
        self._grammar_tokenizer: Any = None

    @property
    def _v(self) -> Any:
        self._model_handle.ptr  # raises ClosedError once the model is freed
        return self._vocab

    @property
    def n_params(self) -> int:
        return int(llama_cpp.llama_model_n_params(self._model_handle.ptr))

    @property
    def model_bytes(self) -> int:
        return int(llama_cpp.llama_model_size(self._model_handle.ptr))

    @property
    def n_nextn(self) -> int:
        """MTP (nextn) layers in the model's GGUF, loaded or not."""
        return int(llama_cpp.llama_model_n_layer_nextn(self._model_handle.ptr))

    @property
    def n_embd(self) -> int:
        return int(llama_cpp.llama_model_n_embd_out(self._model_handle.ptr)) or \
            int(llama_cpp.llama_model_n_embd(self._model_handle.ptr))

    def tokenize(self, text: Union[str, bytes], *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._v, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise DecodeError(f"tokenization of {len(data)} bytes needed {-n} tokens, more than expected")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes token stands for; control tokens render as nothing."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._v, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._v, token, buf, -n, 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def grammar_tokenizer(self) -> Any:
        """This vocabulary as an llguidance tokenizer (built once: about a second for 150k
        tokens), with every end-of-generation token as its EOS."""
        if self._grammar_tokenizer is None:
            import llguidance.llamacpp

            eog = [t for t in range(self.n_vocab) if self.is_eog(t)] or [self.eos]
            with warnings.catch_warnings():  # it reads token attributes with a deprecated binding
                warnings.simplefilter("ignore", DeprecationWarning)
                self._grammar_tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(self._v, eos_token=eog)
        return self._grammar_tokenizer

    def token_text(self, token: int) -> bytes:
        return llama_cpp.llama_vocab_get_text(self._v, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._v, token))

    @property
    def vocab_type(self) -> int:
        return int(llama_cpp.llama_vocab_type(self._v))

    @property
    def bos(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self._v))

    @property
    def eos(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self._v))

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._v))

    @property
    def add_eos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_eos(self._v))

    def fim_tokens(self) -> dict[str, int]:
        """The fill-in-the-middle tokens the GGUF names (prefix, suffix, middle, ...); {} if none."""
        out = {}
        for name in ("pre", "suf", "mid", "pad", "rep", "sep"):
            token = int(getattr(llama_cpp, f"llama_vocab_fim_{name}")(self._v))
            if token >= 0:
                out[name] = token
        return out

    def chat_template(self) -> Optional[str]:
        template = llama_cpp.llama_model_chat_template(self._model_handle.ptr, None)
        return template.decode("utf-8") if template else None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str:
        """Render messages (and tools, as the template's `tools` variable) with the chat template
        stored in the GGUF (jinja, as transformers does)."""
        import jinja2
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.chat_template()
        if template is None:
            raise InvalidParameterError("messages", "...", "used with a model whose GGUF has a chat template; "
                                        "this one has none, so pass a plain prompt to generate()")
        formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=self.token_text(self.eos).decode("utf-8", errors="replace"),
            bos_token=self.token_text(self.bos).decode("utf-8", errors="replace"),
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return formatter(messages=cast(Any, messages), tools=cast(Any, tools)).prompt
        except jinja2.TemplateError as e:  # a template's raise_exception(): roles out of order, ...
            raise InvalidParameterError("messages", "...", f"messages the chat template of {self.name} accepts; "
                                        f"it says: {e}") from None
