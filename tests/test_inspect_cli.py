"""specllama plan and models: what a person runs before loading anything, as a child process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

from conftest import ROOT

GiB = 2**30


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specllama", *args], capture_output=True, text=True, timeout=120)


def planned(out: str, role: str, what: str) -> float:
    line = next(line for line in out.splitlines() if line.startswith(f"{role} "))
    found = re.search(rf"{what} ([\d.]+) GiB", line)
    assert found is not None, (what, line)
    return float(found.group(1))


def test_plan_shows_what_each_model_needs_from_its_header(model_paths):
    runs = {n_ctx: cli("plan", str(model_paths["target"]), "--draft", str(model_paths["draft"]), "--ctx", str(n_ctx))
            for n_ctx in (4096, 8192)}
    for out in runs.values():
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == "fits" and "needed" in out.stdout
    out = runs[4096].stdout
    for role in ("target", "draft"):  # the weights are the file, less its header
        size = model_paths[role].stat().st_size
        assert 0.9 * size <= planned(out, role, "weights") * GiB <= size, (role, out)
    # the KV cache grows with the context, the weights do not
    assert planned(runs[8192].stdout, "target", "KV cache") == 2 * planned(out, "target", "KV cache") > 0
    assert planned(runs[8192].stdout, "target", "weights") == planned(out, "target", "weights")


def test_a_plan_that_cannot_fit_says_so_with_ways_out(model_paths):
    out = cli("plan", str(model_paths["target"]), "--draft", "none", "--ctx", "4000000")
    assert out.returncode == 1 and "does not fit; ways out:" in out.stderr, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr


def test_models_lists_every_alias_and_pair_of_the_shipped_file():
    shipped = tomllib.loads((ROOT / "specllama" / "models.toml").read_text())
    listed = cli("models")
    assert listed.returncode == 0, listed.stderr
    for alias in shipped["aliases"]:
        assert re.search(rf"^  {re.escape(alias)}\s", listed.stdout, re.M), alias
    data = json.loads(cli("models", "--json").stdout)
    assert set(shipped["aliases"]) <= set(data["aliases"])
    assert {p["draft"] for p in shipped["pairs"]} <= {p["draft"] for p in data["pairs"]}
