"""What the terminal shows during `run` and `chat`: the answer, a live status line, notes.

One Screen owns both streams, so nothing else prints into an answer:
- the answer goes to stdout as it streams;
- the status line (tokens, speed, drafted share) is drawn on the terminal's last row, kept
  out of the answer's way by a scroll region (DECSTBM, as apt draws its progress bar): the
  answer scrolls above it and never reaches it. The cursor is saved and restored around each
  draw (DECSC/DECRC), which not every terminal does faithfully right after a full-width line
  (the wrap it owes is forgotten, and the next character overwrites the last column), so the
  screen follows the answer's column and waits for the next token there. Where stdout is not the terminal (piped), the
  status line is stderr's one line rewritten in place; where stderr is not a terminal, none;
- a long prompt's prefill is a bar on the status line (PrefillBar) until the answer starts;
- specllama's log lines (a measurement while the person types, a warning) are held and shown
  on lines of their own between answers (notes()), never inside one.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import unicodedata
from collections.abc import Callable
from typing import Any, Optional, TextIO


class Notes(logging.Handler):
    """Holds specllama's log lines until the screen can show them on lines of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("specllama: %(message)s"))
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self._lines.append(self.format(record))

    def take(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


NOTES = Notes()


def install_notes(verbose: bool) -> None:
    """Route specllama's log lines through NOTES (INFO and up; DEBUG too with --verbose)."""
    logger = logging.getLogger("specllama")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.addHandler(NOTES)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


def _same_terminal(a: TextIO, b: TextIO) -> bool:
    try:
        return a.isatty() and b.isatty() and os.ttyname(a.fileno()) == os.ttyname(b.fileno())
    except (OSError, ValueError, AttributeError):
        return False


class Screen:
    """The terminal of one command. begin() before an answer, text() as it streams, status()
    whenever, end() after it; notes() between answers."""

    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr, live: Optional[bool] = None):
        self.out, self.err = out, err
        self.live = err.isatty() if live is None else live  # a status line at all
        self.shared = self.live and _same_terminal(out, err)  # both on one terminal: a scroll region
        self._rows = 0
        self._column = 0  # the answer's cursor column, as the terminal wraps it
        self._drawn = False

    def _size(self) -> os.terminal_size:
        """The size of the terminal the status line goes to."""
        try:
            return os.get_terminal_size(self.err.fileno())
        except (OSError, ValueError, AttributeError):
            return shutil.get_terminal_size()

    def notes(self) -> None:
        """Show the log lines held so far, each on a line of its own (stderr)."""
        for line in NOTES.take():
            self.err.write(line + "\n")
        self.err.flush()

    def begin(self) -> None:
        """An answer starts (at the start of a line): reserve the last row for the status line."""
        self.notes()
        if not self.shared:
            return
        self._rows = self._size().lines
        if self._rows < 3:
            self.shared = False
            return
        # make room on the last row (a newline scrolls it up if the cursor is there), then
        # limit scrolling to the rows above it; DECSTBM homes the cursor, so save and restore it
        self.err.write(f"\n\033[A\0337\033[1;{self._rows - 1}r\0338")
        self.err.flush()

    def text(self, text: str, style: str = "") -> None:
        """Answer text; style: an SGR sequence (STYLES) it is written in, reset after it."""
        if text:
            self.out.write(f"{style}{text}{RESET}" if style else text)
            self.out.flush()
            self._column = advance(self._column, text, self._size().columns)

    def status(self, line: str) -> None:
        if not self.live:
            return
        width = self._size().columns
        line = line[:max(0, width - 1)]
        if self.shared and self._column >= width:  # a wrap pending: drawn after the next token
            return
        if self.shared:
            self.err.write(f"\0337\033[{self._rows};1H\033[2K{line}\0338")
        else:
            self.err.write(f"\r\033[2K{line}")
        self._drawn = True
        self.err.flush()

    def end(self) -> None:
        """The answer ended: clear the status line and give the whole screen back."""
        if self.shared:
            self.err.write(f"\0337\033[{self._rows};1H\033[2K\033[r\0338")
        elif self._drawn:
            self.err.write("\r\033[2K")
        self._drawn = False
        self.err.flush()


def advance(column: int, text: str, width: int) -> int:
    """The cursor column after writing text from column on a terminal width columns wide:
    width itself means the line is full and the terminal wraps at the next character."""
    for ch in text:
        if ch in "\n\r":
            column = 0
        elif ch == "\t":
            column = min(max(column, 0) // 8 * 8 + 8, width - 1) if column < width else 8
        elif unicodedata.category(ch) in ("Mn", "Me", "Cf") or ord(ch) < 32:
            continue
        else:
            n = 2 if unicodedata.east_asian_width(ch) in "WF" else 1
            column = n if column + n > width else column + n
    return column


# --color: tokens the draft model proposed and the target kept, tokens prompt lookup copied
# and the target kept; the target's own (and a grammar's only choice) stay plain
STYLES = {"draft": "\033[32m", "lookup": "\033[36m"}  # green, cyan
RESET = "\033[0m"


def style_of(origins: list[str]) -> str:
    """The style of a chunk's text: its tokens' (Chunk.origins), where they agree; else plain."""
    return STYLES.get(origins[0], "") if origins and origins.count(origins[0]) == len(origins) else ""


class ColorLegend:
    """What the colours meant, counted over an answer's chunks."""

    def __init__(self, draft_name: str) -> None:
        self.draft_name = draft_name
        self.counts = {"draft": 0, "lookup": 0, "target": 0}

    def add(self, origins: list[str]) -> None:
        for origin in origins:
            self.counts[origin if origin in self.counts else "target"] += 1

    def line(self) -> str:
        c = self.counts
        return (f"colors: {STYLES['draft']}green{RESET} {c['draft']} tokens drafted by {self.draft_name} and kept, "
                f"{STYLES['lookup']}cyan{RESET} {c['lookup']} copied by prompt lookup and kept, "
                f"plain {c['target']} the target's own")


class PrefillBar:
    """A prompt's prefill as a status line (an on_progress for stream()), drawn only where the
    prefill looks to take min_seconds or more (timed on its first batch): a short prompt draws
    nothing. close() clears a drawn bar before the answer."""

    def __init__(self, draw: Callable[[str], None], clear: Callable[[], None] = lambda: None,
                 min_seconds: float = 2.0):
        self._draw, self._clear, self._min_seconds = draw, clear, min_seconds
        self.shown = False

    def __call__(self, progress: Any) -> None:
        n_done = progress.processed - progress.cache
        if n_done <= 0:
            return
        seconds = progress.time_ms / 1000
        seconds_left = seconds * (progress.total - progress.processed) / n_done
        if not self.shown and seconds + seconds_left < self._min_seconds:
            return
        self.shown = True
        self._draw(bar_line(progress, seconds_left))

    def close(self) -> None:
        if self.shown:
            self._clear()
            self.shown = False


def bar_line(progress: Any, seconds_left: float, width: int = 20) -> str:
    """"reading the prompt [#####---------------] 2,048/8,192 tokens (25%), 512 cached, 1 min 4 s left"."""
    share = progress.processed / progress.total if progress.total else 1.0
    n_full = int(share * width)
    cached = f", {progress.cache:,} cached" if progress.cache else ""
    left = f", {_duration(seconds_left)} left" if progress.processed < progress.total else ""
    return (f"reading the prompt [{'#' * n_full}{'-' * (width - n_full)}] {progress.processed:,}/{progress.total:,} "
            f"tokens ({share:.0%}){cached}{left}")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"
