"""`bench --plot` and `doctor --plot` draw what decides a draft's worth: a PNG matplotlib reads
back, of the size its panels make; bad --plot values are refused before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SETTINGS
from specllama.controller import Costs
from specllama.controller.costs import ideal_speedup
from specllama.plots import acceptance_by_position

pytestmark = pytest.mark.children


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specllama", *args], capture_output=True, text=True, timeout=600)


def image(path) -> tuple[int, int]:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.std() > 0.05  # drawn, not blank
    return pixels.shape[1], pixels.shape[0]


def test_bench_and_doctor_draw_their_panels(tiny_paths, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count from one to ten."}) + "\n")
    pair = [str(tiny_paths["hybrid-target"]), "--draft", str(tiny_paths["attention-draft"]), "--ctx", "1024",
            "-t", str(SETTINGS["n_threads"])]
    out = command("bench", *pair, "--prompts", str(prompts), "-n", "24", "--repeats", "1",
                  "--plot", str(tmp_path / "bench.png"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "drawn: " in out.stderr and (tmp_path / "bench.png").stat().st_size > 20_000
    assert image(tmp_path / "bench.png") == (1500, 400)  # three panels: costs, acceptance, speed
    out = command("doctor", *pair, "--plot", str(tmp_path / "doctor.png"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert image(tmp_path / "doctor.png") == (1000, 400)  # costs and the speed they allow


def test_a_bad_plot_is_refused_before_anything_loads(tiny_paths, tmp_path):
    for args, says in ((["doctor", "--plot", str(tmp_path / "a.png")], "give a MODEL"),
                       (["doctor", str(tiny_paths["attention-draft"]), "--plot", str(tmp_path / "a.txt")],
                        "ending in .png")):
        out = command(*args)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / "a.png").exists()


def test_the_speed_the_costs_allow_and_the_acceptance_by_position():
    flat = Costs(verify=(0.010,) * 16, draft_token=0.002)  # a GPU-like flat curve, a draft a fifth of it
    assert ideal_speedup(flat, 0) == 1.0
    assert ideal_speedup(flat, 4) == pytest.approx(5 * 0.010 / (4 * 0.002 + 0.010))
    steep = Costs(verify=tuple(0.010 * n for n in range(1, 17)), draft_token=0.002)  # each row a step's cost
    assert ideal_speedup(steep, 4) < 1.0
    assert acceptance_by_position([10, 8, 0], [9, 4, 0]) == [0.9, 0.5, 0.0]
