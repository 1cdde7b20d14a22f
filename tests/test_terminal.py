"""What the terminal really shows (a pseudo-terminal read through pyte, a terminal emulator),
Ctrl-C at every moment, and llama.cpp's flag spellings."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pyte
import pytest

import specllama
from conftest import SETTINGS

pytestmark = pytest.mark.children  # each test waits on a llama.cpp child

ROWS, COLS = 12, 80  # small, so the answer scrolls past the row the status line is drawn on
PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and two examples."


def model_args(model_paths, target: str = "target", draft: str = "draft"):
    return [str(model_paths[target]), "--draft", str(model_paths[draft]), "--ctx", str(SETTINGS["n_ctx"]),
            "--threads", str(SETTINGS["n_threads"])]


def small_args(model_paths):
    """SmolLM2 drafting for itself: what the screen shows does not depend on the pair, and the
    135M model loads, measures and decodes 3-4x faster than the Qwen pair."""
    return model_args(model_paths, "smollm2", "smollm2")


@pytest.fixture(scope="module")
def small_pair(model_paths):
    """small_args' pair in this process, for the text a child should show."""
    with specllama.load(model_paths["smollm2"], model_paths["smollm2"], n_draft=4, **SETTINGS) as llm:
        yield llm


def screen_of(child_output: str, rows: int = ROWS, cols: int = COLS) -> list[str]:
    """Every line the terminal showed, scrolled-off ones first, as a person would read them."""
    screen = pyte.HistoryScreen(cols, rows, history=10_000)
    screen.set_mode(pyte.modes.LNM)  # a newline returns the carriage, as a terminal's onlcr does
    pyte.Stream(screen).feed(child_output)
    history = ["".join(line[x].data for x in range(cols)) for line in screen.history.top]
    return [line.rstrip() for line in history + screen.display]


def wrapped(text: str, cols: int = COLS) -> list[str]:
    out = []
    for line in text.split("\n"):
        out += [line[i:i + cols].rstrip() for i in range(0, max(len(line), 1), cols)]
    return out


def run_in_terminal(args: list[str], rows: int = ROWS, cols: int = COLS) -> str:
    """`specllama run ARGS` in a pseudo-terminal of rows x cols: all it wrote, once it exited 0."""
    child = pexpect.spawn(sys.executable, ["-m", "specllama", "run", *args], encoding="utf-8", timeout=300,
                          dimensions=(rows, cols))
    child.logfile_read = io.StringIO()
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)  # a timed-out child is killed, not left running
    assert child.exitstatus == 0, child.before
    return child.logfile_read.getvalue()


def test_run_s_status_line_never_lands_in_the_answer(model_paths, small_pair):
    """In colour (--color): the colours change no character of the answer or of its wrapping."""
    expected = small_pair.chat([{"role": "user", "content": PROMPT}], max_tokens=160).text
    seen = run_in_terminal([*small_args(model_paths), PROMPT, "--max-tokens", "160", "--color", "--n-draft", "3"])
    lines = screen_of(seen)
    start = next(i for i, line in enumerate(lines) if line and expected.split("\n")[0].startswith(line[:20]))
    answer = lines[start:start + len(wrapped(expected))]
    assert answer == wrapped(expected), repr(seen[-3000:])  # the screen shows the text, nothing else
    assert not any("drafted (" in line for line in lines)  # the status line is gone once it ended
    after = "".join(lines[start + len(wrapped(expected)):])  # the stats line, wrapped at COLS
    assert after.startswith("[") and "drafted by" in after and "tok/s" in after, lines
    # green where the draft's tokens were kept, plain for the target's own; the legend counts them
    cells = colored_lines(seen)
    texts = ["".join(ch for ch, _ in line).rstrip() for line in cells]
    first = texts.index(lines[start])
    answer = cells[first:first + len(wrapped(expected))]
    assert ["".join(ch for ch, _ in line).rstrip() for line in answer] == wrapped(expected)
    colors = {fg for line in answer for ch, fg in line if ch.strip()}
    assert colors == {"green", "default"}, colors
    legend = after[after.index("colors: "):]
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (tokens drafted|copied|the target)", legend)}
    assert counts["tokens drafted"] > 0 and counts["copied"] == 0 and sum(counts.values()) == 160, legend


def test_a_status_drawn_after_a_full_width_line_leaves_the_line_whole():
    """Some terminals forget the wrap a full line owes when the cursor is restored: the status
    line waits for the next token there, so the answer's last column survives."""
    import fcntl
    import os
    import struct
    import termios

    from specllama.cli.screen import NOTES, Screen, advance

    NOTES.take()  # log lines earlier tests of this process left for a screen to show

    assert advance(0, "a" * COLS, COLS) == COLS and advance(COLS, " b", COLS) == 2
    assert advance(COLS - 1, "漢", COLS) == 2 and advance(3, "x\n", COLS) == 0
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    tty = os.fdopen(slave, "w")
    screen = Screen(tty, tty)
    full = "x" * (COLS - 3) + "end"
    screen.begin()
    for piece in ["first line\n", full, " next", " line\n"]:
        screen.text(piece)
        screen.status("12 tok, 9.0 tok/s")
    screen.end()
    tty.close()
    raw = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        raw += chunk
    os.close(master)
    shown = [line for line in screen_of(raw.decode()) if line]
    assert shown == ["first line", full, " next line"], shown


def test_chat_shows_one_time_notes_between_turns_not_inside_answers(model_paths, small_pair, tmp_path):
    # a fresh machine: the first turns trigger one-time measurements, run while the person types
    env = {"SPECLLAMA_HOME": str(tmp_path), "SPECLLAMA_IDLE_WORK": "1"}
    questions = ["Name three primary colors, one per line.", "And three secondary colors, one per line?"]
    child = pexpect.spawn(sys.executable, ["-m", "specllama", "chat", *small_args(model_paths), "--max-tokens", "40",
                                           "-v"], encoding="utf-8", timeout=300, dimensions=(200, 200),
                          env={**__import__("os").environ, **env})
    child.logfile_read = io.StringIO()  # the whole session (child.before holds only the last part)
    try:
        for q in questions:
            child.expect_exact(">>> ")
            time.sleep(3)  # the person types; idle work runs and its lines wait for a line of their own
            child.sendline(q)
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    lines = screen_of(child.logfile_read.getvalue(), rows=200, cols=200)
    history: list[dict] = []
    for q in questions:
        history.append({"role": "user", "content": q})
        answer = small_pair.chat(history, max_tokens=40).text
        history.append({"role": "assistant", "content": answer})
        at = next(i for i, line in enumerate(lines) if line.endswith(q))
        assert lines[at + 1:at + 1 + len(answer.split("\n"))] == answer.split("\n"), lines[at:at + 12]
    notes = [line for line in lines if line.startswith("specllama: ")]
    assert notes and all(line.startswith("specllama: ") for line in notes)  # each on a line of its own


def interrupt_at(args, seconds, model_paths, expect=None):
    proc = subprocess.Popen([sys.executable, "-m", "specllama", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    try:
        if expect is not None:  # wait for text, then interrupt (mid-generation)
            deadline = time.monotonic() + 120
            seen = ""
            while expect not in seen and time.monotonic() < deadline:
                seen += proc.stdout.read(1)
        else:
            time.sleep(seconds)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


# 0.5 s: still importing; 1.5 s: loading the models (chat is at its prompt by then on a fast machine)
@pytest.mark.parametrize("command, seconds", [("run", 0.5), ("run", 1.5), ("bench", 1.5), ("doctor", 1.5),
                                              ("serve", 1.5), ("chat", 0.5)])
def test_ctrl_c_while_loading_exits_130_without_a_traceback(model_paths, tmp_path, command, seconds):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    extra = {"run": ["hello"], "bench": ["--prompts", str(prompts)], "doctor": [], "serve": ["--port", "0"],
             "chat": []}[command]
    code, err = interrupt_at([command, *model_args(model_paths), *extra], seconds, model_paths)
    assert code == 130 and "Traceback" not in err and "Exception ignored" not in err, (code, err[-2000:])


def test_ctrl_c_mid_generation_exits_130_without_a_traceback(model_paths):
    code, err = interrupt_at(["run", *model_args(model_paths), "Count from 1 to 300, one per line.", "-n", "600"],
                             0, model_paths, expect="12")
    assert code == 130 and "Traceback" not in err, (code, err[-2000:])


ALIASES = [  # llama.cpp's spelling, then specllama's long form: the same settings reach the model
    (["-c", "1024", "-t", "1", "-ngl", "0", "-fa", "off", "-ctk", "q8_0", "-ctv", "f16", "-n", "3", "-s", "7",
      "--repeat-penalty", "1.1"],
     ["--ctx-size", "1024", "--threads", "1", "--gpu-layers", "0", "--flash-attn", "off", "--cache-type-k", "q8_0",
      "--cache-type-v", "f16", "--max-tokens", "3", "--seed", "7", "--repeat-penalty", "1.1"]),
    pytest.param(["--n-predict", "2", "-ngld", "0", "--n-gpu-layers", "0"],
                 ["--max-tokens", "2", "--draft-gpu-layers", "0", "--gpu-layers", "0"],
                 marks=pytest.mark.slow),  # the rarer spellings: with SPECLLAMA_SLOW=1 (the suite's time)
]


@pytest.mark.parametrize("alias, long_form", ALIASES)
def test_llama_cpp_flag_spellings_reach_the_same_settings(tiny_paths, alias, long_form):
    # the tiny attention model as target and draft: spellings do not depend on the pair
    tiny = str(tiny_paths["attention-draft"])

    def settings(flags, model_flag):
        model = ["-m", tiny] if model_flag else [tiny]
        draft = ["-md", tiny] if model_flag else ["--draft", tiny]
        out = subprocess.run([sys.executable, "-m", "specllama", "run", *model, *draft, *flags, "--json", "-p", "hi"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)["settings"]

    assert settings(alias, True) == settings(long_form, False)


def test_options_are_checked_before_anything_loads(model_paths):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "specllama", "run", str(model_paths["target"]), "hi",
                          "--max-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--max-tokens" in out.stderr and "max_tokens=" not in out.stderr
    assert time.monotonic() - t0 < 15  # no model was loaded to find out
    ok = subprocess.run([sys.executable, "-m", "specllama", "run", str(model_paths["target"]), "--draft", "none",
                         "--exact", "0.1", "--ctx", "0", "-n", "2", "--json", "-p", "hi"], capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["settings"]["n_ctx"] == 32768  # --ctx 0: the model's trained context
    assert specllama.__version__


def test_compare_runs_both_twice_alternated_and_says_when_it_is_noise(model_paths):
    out = subprocess.run([sys.executable, "-m", "specllama", "run", *small_args(model_paths), "def add(a, b):",
                          "--raw", "-n", "16", "--compare", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    plain = json.loads(out.stdout)["plain"]
    assert len(plain["speedups"]) == 2 and all(x > 0 for x in plain["speedups"]) and plain["identical"]
    shown = subprocess.run([sys.executable, "-m", "specllama", "run", *small_args(model_paths), "def add(a, b):",
                            "--raw", "-n", "16", "--compare"], capture_output=True, text=True, timeout=300)
    line = next(x for x in shown.stderr.splitlines() if x.startswith("speedup:"))
    assert "two runs each, alternated" in line


def test_an_interrupt_inside_code_built_from_a_string_still_exits_130(tmp_path):
    # dataclasses and namedtuple run source strings while modules import; a Ctrl-C landing there
    # made `python -m specllama` die of SIGINT (-2) though the CLI caught it and printed "interrupted"
    (tmp_path / "spin.py").write_text("from specllama.errors import exit_interrupted\n"
                                      "try:\n    print('ready', flush=True)\n    exec('while True: pass')\n"
                                      "except KeyboardInterrupt:\n    exit_interrupted()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[1])])}
    proc = subprocess.Popen([sys.executable, "-m", "spin"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "\ninterrupted\n", (proc.returncode, err)


def test_a_long_prefill_shows_a_bar_that_is_gone_when_the_answer_starts(model_paths, tmp_path):
    """SmolLM2 reads about 2,000 tokens in about 4 s on 2 cores: long enough for the bar (its first
    batch says the prefill will take over two seconds), short enough for the suite."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The sea was calm and the ships sailed on. " * 200 + "\nIn one word, the sea was")
    seen = run_in_terminal([str(model_paths["smollm2"]), "--draft", "none", "--raw", "-f", str(prompt),
                            "--max-tokens", "3", "--threads", str(SETTINGS["n_threads"])])
    drawn = [part for part in seen.split("\033[2K") if part.startswith("reading the prompt [")]
    assert len(drawn) >= 3 and re.match(r"reading the prompt \[#+-+\] 512/2,\d{3} tokens \(\d+%\), \d+ s left",
                                        drawn[0]), drawn  # each batch redraws it
    assert not any("reading the prompt" in line for line in screen_of(seen))  # gone once the answer began


def test_the_prefill_bar_is_drawn_only_for_a_long_prefill_and_says_how_far_it_is():
    from specllama.cli.screen import PrefillBar
    from specllama.streams import PromptProgress

    for batch_ms, drawn in ((100.0, 0), (1500.0, 4)):  # 4 batches of 0.1 s, or of 1.5 s
        lines: list[str] = []
        bar = PrefillBar(lines.append)
        for i in range(5):
            bar(PromptProgress(total=2048 + 256, cache=256, processed=256 + 512 * i, time_ms=batch_ms * i))
        assert len(lines) == drawn, lines
    assert lines[0] == "reading the prompt [######--------------] 768/2,304 tokens (33%), 256 cached, 4 s left"
    assert lines[-1] == "reading the prompt [####################] 2,304/2,304 tokens (100%), 256 cached"
    cleared: list[str] = []
    bar = PrefillBar(lines.append, lambda: cleared.append("clear"))
    bar.close()
    bar(PromptProgress(total=100_000, cache=0, processed=512, time_ms=1000.0))
    assert "about" not in lines[-1] and "3 min 14 s left" in lines[-1]
    bar.close()
    assert cleared == ["clear"]  # cleared once, and only once drawn


def colored_lines(output: str, rows: int = ROWS, cols: int = COLS) -> list[list[tuple[str, str]]]:
    """Every line the terminal showed, scrolled-off ones first, as (character, colour) cells."""
    screen = pyte.HistoryScreen(cols, rows, history=10_000)
    screen.set_mode(pyte.modes.LNM)
    pyte.Stream(screen).feed(output)
    lines = [*screen.history.top, *(screen.buffer[y] for y in range(rows))]
    return [[(line[x].data, line[x].fg) for x in range(cols)] for line in lines]


def test_run_color_shows_prompt_lookup_s_kept_tokens_in_cyan(model_paths):
    """(The draft model's green: test_run_s_status_line_never_lands_in_the_answer.)"""
    echo = "Repeat this line exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa"
    lines = colored_lines(run_in_terminal([str(model_paths["target"]), "--draft", "ngram", "--ctx",
                                           str(SETTINGS["n_ctx"]), "--threads", str(SETTINGS["n_threads"]), echo,
                                           "--max-tokens", "24", "--n-draft", "3", "--color"]))
    texts = ["".join(ch for ch, _ in line).rstrip() for line in lines]
    legend = "".join(texts[next(i for i, t in enumerate(texts) if t.startswith("colors: ")):])
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (tokens drafted|copied|the target)", legend)}
    assert counts["copied"] > 0 and counts["tokens drafted"] == 0, legend
    answer = [line for line, text in zip(lines, texts) if not text.startswith(("specllama: ", "[", "colors: "))]
    assert {fg for line in answer for ch, fg in line if ch.strip()} == {"cyan", "default"}
