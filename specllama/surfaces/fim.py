"""Fill-in-the-middle prompts from a GGUF's FIM tokens, in llama-server's repo-level layout:

    [FIM_REP]myproject\\n [FIM_SEP]file\\n extra chunk ... [FIM_SEP]filename\\n
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

The prefix keeps its end and the suffix its start so both fit one batch (3:1), and extra
chunks (other files) fill what the context has left. Pure: tokenize is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import InvalidParameterError

Tokenize = Callable[[str], list[int]]
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks where the vocabulary has no FIM_SEP


def fim_prompt(tokenize: Tokenize, fim: dict[str, int], prefix: str, suffix: str, *, prompt: str = "",
               extra: Sequence[dict] = (), n_batch: int = 512, n_ctx: int = 4096, n_predict: int = 128,
               bos: int | None = None) -> list[int]:
    """The FIM prompt's tokens. fim: the model's FIM tokens ({"pre", "suf", "mid", "rep"?, "sep"?}).

    Raises InvalidParameterError when the model has no FIM tokens."""
    if not all(k in fim for k in ("pre", "suf", "mid")):
        raise InvalidParameterError("input_prefix", "...", "used with a model whose GGUF has fill-in-the-middle "
                                    "tokens (FIM prefix, suffix, middle); this one has none")
    extra_tokens: list[int] = []
    if "rep" in fim:
        extra_tokens += [fim["rep"], *tokenize("myproject\n")]
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) \
                or not isinstance(chunk.get("filename", ""), str):
            raise InvalidParameterError(f"input_extra.{i}", chunk, '{"filename": string, "text": string}')
        head = [fim["sep"], *tokenize(chunk.get("filename", "tmp") + "\n")] if "sep" in fim else \
            tokenize(CHUNK_SEPARATOR)
        extra_tokens += head + tokenize(chunk["text"])
    if "sep" in fim:
        extra_tokens += [fim["sep"], *tokenize("filename\n")]
    prompt_tokens = tokenize(prompt) if prompt else []
    prefix_tokens, suffix_tokens = tokenize(prefix), tokenize(suffix)
    n_prefix = min(len(prefix_tokens), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_tokens), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [bos] if bos is not None else []
    return [*extra_tokens[len(extra_tokens) - n_extra:], *head, fim["pre"],
            *prefix_tokens[len(prefix_tokens) - n_prefix:], *prompt_tokens, fim["suf"], *suffix_tokens[:n_suffix],
            fim["mid"]]
