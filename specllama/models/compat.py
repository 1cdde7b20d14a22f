"""Draft/target compatibility, with llama.cpp's rules (common/speculative.cpp).

A draft is only useful if token id i means the same text in both vocabularies: otherwise the
target verifies tokens the draft never meant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import IncompatibleDraftError

MAX_VOCAB_SIZE_DIFFERENCE = 128
CHECK_START_TOKEN_ID = 5  # ids below this are special tokens that may legitimately differ


@dataclass(frozen=True)
class VocabInfo:
    """What the check needs to know about one model's vocabulary."""

    name: str
    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_text: Callable[[int], bytes]


def vocab_info(model: Any) -> VocabInfo:
    """VocabInfo of a loaded model (a runtime.Model)."""
    return VocabInfo(model.name, model.vocab_type, model.n_vocab, model.bos, model.eos, model.add_bos,
                     model.add_eos, model.token_text)


def check_compatible(target: VocabInfo, draft: VocabInfo) -> None:
    """Raise IncompatibleDraftError naming the first difference between the vocabularies."""

    def fail(what: str) -> None:
        raise IncompatibleDraftError(
            f"draft {draft.name} cannot be used with target {target.name}: {what}; "
            "pick a draft from the same model family (same tokenizer)"
        )

    for attr, label in (("vocab_type", "vocabulary type"), ("add_bos", "add-BOS flag"),
                        ("add_eos", "add-EOS flag"), ("bos", "BOS token"), ("eos", "EOS token")):
        t, d = getattr(target, attr), getattr(draft, attr)
        if t != d:
            fail(f"{label} differs (target {t}, draft {d})")
    if abs(target.n_vocab - draft.n_vocab) > MAX_VOCAB_SIZE_DIFFERENCE:
        fail(f"vocabulary sizes differ by more than {MAX_VOCAB_SIZE_DIFFERENCE} "
             f"(target {target.n_vocab}, draft {draft.n_vocab})")
    for token in range(CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        t, d = target.token_text(token), draft.token_text(token)
        if t != d:
            fail(f"token {token} is {t.decode('utf-8', 'replace')!r} in the target "
                 f"but {d.decode('utf-8', 'replace')!r} in the draft")


# llama.cpp's vocabulary types by tokenizer.ggml.model, and its add-BOS default for each
_VOCAB_TYPES = {"no_vocab": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}
_ADD_BOS_DEFAULT = {1: True, 3: True}


def vocab_info_from_gguf(name: str, fields: dict) -> VocabInfo:
    """VocabInfo from GGUF metadata alone (no weights), for checking a draft before download."""
    tokens = fields.get("tokenizer.ggml.tokens") or []
    vocab_type = _VOCAB_TYPES.get(fields.get("tokenizer.ggml.model", ""), -1)
    encoded = [t.encode("utf-8") for t in tokens]
    return VocabInfo(
        name=name,
        vocab_type=vocab_type,
        n_vocab=len(tokens),
        bos=fields.get("tokenizer.ggml.bos_token_id", -1),
        eos=fields.get("tokenizer.ggml.eos_token_id", -1),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", _ADD_BOS_DEFAULT.get(vocab_type, False))),
        add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        token_text=encoded.__getitem__,
    )


def early_mismatch(target: VocabInfo, partial: dict, array_lengths: dict) -> str | None:
    """A reason the draft cannot match, decided from the start of its header, or None."""
    model = partial.get("tokenizer.ggml.model")
    if model is not None and _VOCAB_TYPES.get(model, -1) != target.vocab_type:
        return f"vocabulary type differs (tokenizer {model!r})"
    n_tokens = array_lengths.get("tokenizer.ggml.tokens")
    if n_tokens is not None and abs(n_tokens - target.n_vocab) > MAX_VOCAB_SIZE_DIFFERENCE:
        return (f"vocabulary sizes differ by more than {MAX_VOCAB_SIZE_DIFFERENCE} "
                f"(target {target.n_vocab}, draft {n_tokens})")
    return None
