"""`specllama chat`: an interactive chat in the terminal on SpecLlama's chat stream.

The history is kept between turns and the prompt cache keeps its KV state, so each turn
decodes only what is new. Ctrl-C stops the answer being written (what was written stays in
the history) and leaves the chat running; Ctrl-D or /bye leaves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Optional, TextIO

from ..errors import PromptTooLongError, SpecLlamaError
from .screen import RESET, PrefillBar, Screen, style_of

HELP = ("/reset forgets the conversation, /stats shows the last answer's figures, /help this line, /bye or "
        "Ctrl-D leaves; Ctrl-C stops an answer")


def chat_loop(llm: Any, options: dict, *, system: Optional[str] = None, show_stats: bool = False,
              read: Callable[[str], str] = input, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
              color: bool = False) -> None:
    """Read a line, stream the answer, repeat until end of input or /bye.

    Args:
        llm: the SpecLlama to chat with.
        options: generation options for each answer (temperature, max_tokens, ...); without
            max_tokens an answer may fill the rest of the context.
        system: a system message that starts the history (and stays after /reset).
        show_stats: print the figures of each answer after it.
        color: write the answers in colours saying who chose each token (screen.STYLES).
        read, out, err: the prompt reader and the output streams.
    """

    screen = Screen(out, err, live=False)  # log lines wait for a line of their own between turns
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    last = None
    err.write(f"chatting with {llm.target.name}"
              + (f" (drafted by {llm.draft.name})" if llm.draft is not None else "") + f". {HELP}.\n")
    while True:
        screen.notes()
        try:
            line = read(">>> ")
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n(Ctrl-D or /bye leaves)\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            return
        if text == "/reset":
            history = list(start)
            out.write("(the conversation is forgotten)\n")
            continue
        if text == "/stats":
            out.write((last.summary() if last is not None else "no answer yet") + "\n")
            continue
        if text in ("/help", "/?"):
            out.write(HELP + "\n")
            continue
        if text.startswith("/"):
            out.write(f"unknown command {text}; {HELP}\n")
            continue
        history.append({"role": "user", "content": text})
        answer, stats = _answer(llm, history, options, out, err, color)
        if answer is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})
        last = stats
        if show_stats and stats is not None:
            err.write(stats.summary() + "\n")


def _answer(llm: Any, history: list[dict], options: dict, out: TextIO, err: TextIO,
            color: bool = False) -> tuple[Optional[str], Any]:
    """Stream one answer; (its text, its stats), or (None, None) when it could not start."""
    bar = PrefillBar(lambda line: _draw(err, line), lambda: _draw(err, ""))
    try:
        tokens = llm.chat_tokens(history)
        room = llm.target.n_ctx - len(tokens)
        stream = llm.stream(tokens, **{"max_tokens": max(1, room), **options,
                                       "on_progress": bar if err.isatty() else None})
    except PromptTooLongError as e:
        err.write(f"{e}; /reset starts a new conversation\n")
        return None, None
    except SpecLlamaError as e:
        err.write(f"{type(e).__name__}: {e}\n")
        return None, None
    pieces = []
    try:
        for chunk in stream:
            bar.close()
            style = style_of(chunk.origins) if color and chunk.text else ""
            out.write(f"{style}{chunk.text}{RESET}" if style else chunk.text)
            out.flush()
            pieces.append(chunk.text)
    except KeyboardInterrupt:
        stream.close()
        out.write(" [stopped]")
    except SpecLlamaError as e:
        stream.close()
        err.write(f"\n{type(e).__name__}: {e}\n")
    finally:
        bar.close()
    out.write("\n")
    return "".join(pieces), stream.result.stats if stream.result is not None else None


def _draw(err: TextIO, line: str) -> None:
    """line in place of the terminal's current line (stderr)."""
    err.write(f"\r\033[2K{line}")
    err.flush()
