"""`specllama chat` in a real pseudo-terminal, as a person types into it."""

from __future__ import annotations

import sys

import pexpect
import pytest

from conftest import SETTINGS

pytestmark = pytest.mark.children  # each test waits on a llama.cpp child


def test_two_turns_reset_ctrl_c_and_another_turn(model_paths):
    child = pexpect.spawn(sys.executable, ["-m", "specllama", "chat", str(model_paths["target"]), "--draft",
                                           str(model_paths["draft"]), "--ctx", str(SETTINGS["n_ctx"]), "--threads",
                                           str(SETTINGS["n_threads"]), "--max-tokens", "400", "--stats"],
                          encoding="utf-8", timeout=180, dimensions=(40, 200))
    try:
        child.expect_exact(">>> ")
        child.sendline("Name three primary colors, one per line.")
        child.expect(r"(\d+) tokens, .* tok/s")  # the answer, then its --stats line
        child.expect_exact(">>> ")
        child.sendline("And three secondary colors?")
        # the second turn decodes only what is new: its prompt is mostly cached
        child.expect(r"prefill (\d+) tokens in [\d.]+s \((\d+) of (\d+) cached")
        n_new, n_cached, n_prompt = (int(g) for g in child.match.groups())
        assert n_cached > n_new and n_cached + n_new == n_prompt
        child.expect_exact(">>> ")
        child.sendline("/reset")
        child.expect_exact("forgotten")
        child.expect_exact(">>> ")
        child.sendline("Count from 1 to 100, one number per line, nothing else.")
        child.expect(r"\n\s*3\s*\n")  # the answer is being written
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"(\d+) tokens, ")
        # stopped before max_tokens (the count is ~290 tokens: long enough that a fast round,
        # e.g. prompt lookup's, cannot finish it before the interrupt arrives)
        assert int(child.match.group(1)) < 280
        child.expect_exact(">>> ")
        child.sendline("Thanks. Which number came first?")
        child.expect(r"(\d+) tokens, .* tok/s")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
