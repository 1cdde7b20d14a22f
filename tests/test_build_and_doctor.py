"""setup.sh picks the llama.cpp build for the machine; `specllama doctor` says what the build can do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.children  # each test waits on a llama.cpp child

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"


def stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def print_build(tmp_path: Path, *, uname: tuple[str, str], gpu: bool, nvcc: bool, cmake_args: str = "",
                rpc: str = "") -> tuple[int, str]:
    """Run setup.sh --print-build with stand-in uname / nvidia-smi / nvcc first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "uname", f'case "$1" in -s) echo {uname[0]};; -m) echo {uname[1]};; *) echo {uname[0]};; esac')
    if gpu:
        stand_in(bin_dir, "nvidia-smi", 'echo "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-1234)"')
    if nvcc:
        stand_in(bin_dir, "nvcc", 'echo "Cuda compilation tools, release 12.4, V12.4.131"')
    # a PATH with the stand-ins and the basic tools, but not the real nvidia-smi/nvcc if any
    path = f"{bin_dir}:/usr/bin:/bin"
    env = {**os.environ, "PATH": path, "CMAKE_ARGS": cmake_args, "SPECLLAMA_RPC": rpc}
    done = subprocess.run(["bash", str(SETUP), "--print-build"], capture_output=True, text=True, env=env, timeout=30)
    return done.returncode, done.stdout + done.stderr


def test_cuda_with_the_toolkit(tmp_path):
    rc, out = print_build(tmp_path, uname=("Linux", "x86_64"), gpu=True, nvcc=True)
    assert rc == 0 and "build: cuda+rpc" in out and "CMAKE_ARGS: -DGGML_CUDA=on -DGGML_RPC=ON" in out
    assert "RTX 4090" in out and "release 12.4" in out


def test_an_nvidia_gpu_without_the_toolkit_says_what_to_install(tmp_path):
    rc, out = print_build(tmp_path, uname=("Linux", "x86_64"), gpu=True, nvcc=False)
    assert rc != 0
    assert "no CUDA toolkit" in out and "nvcc" in out and "install" in out.lower()
    assert "-DGGML_CUDA=off" in out  # the way to a CPU build on purpose


def test_apple_silicon_gets_metal(tmp_path):
    rc, out = print_build(tmp_path, uname=("Darwin", "arm64"), gpu=False, nvcc=False)
    assert rc == 0 and "build: metal+rpc" in out and "CMAKE_ARGS: -DGGML_METAL=on -DGGML_RPC=ON" in out


def test_plain_cpu_gets_native_without_amx(tmp_path):
    rc, out = print_build(tmp_path, uname=("Linux", "x86_64"), gpu=False, nvcc=False)
    assert rc == 0 and "build: cpu+rpc" in out and "CMAKE_ARGS: -DGGML_RPC=ON\n" in out
    assert "CFLAGS: -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in out


def test_rpc_can_be_left_out(tmp_path):
    rc, out = print_build(tmp_path, uname=("Linux", "x86_64"), gpu=False, nvcc=False, rpc="0")
    assert rc == 0 and "build: cpu\n" in out and "RPC" not in out


def test_the_users_cmake_args_win(tmp_path):
    rc, out = print_build(tmp_path, uname=("Linux", "x86_64"), gpu=True, nvcc=False, cmake_args="-DGGML_VULKAN=on")
    assert rc == 0 and "build: custom" in out and "CMAKE_ARGS: -DGGML_VULKAN=on" in out


def doctor(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "specllama", "doctor", *args, "--json"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_doctor_reports_the_build_on_this_cpu_machine():
    report = doctor()
    assert "CPU" in report["backends"]
    assert "RPC" in report["backends"] and report["rpc"] is True  # setup.sh builds the RPC backend in
    assert report["gpu_offload"] is False
    cpu = next(d for d in report["devices"] if d["kind"] == "cpu")
    assert cpu["total"] > 2**30
    assert "AVX" in report["llama_cpp"]["system_info"] and report["llama_cpp"]["llama_cpp_python"] == "0.3.36"


@pytest.mark.slow
def test_doctor_with_a_model_gives_fidelity_costs_and_a_verdict(model_paths):
    report = doctor(str(model_paths["target"]), "--draft", str(model_paths["draft"]), "--ctx", "2048",
                    "--threads", "2")
    m = report["model"]
    assert [row["kv"] for row in m["fidelity"]] == ["KV <= 256", "KV <= 512", "KV 768-1024"]
    for row in m["fidelity"]:
        assert 1 <= row["max_verify_bitwise"] <= row["max_verify_rounding"] <= 17
        assert 0 < row["verify_ms"]["1"] <= row["verify_ms"].get("4", row["verify_ms"]["1"]) * 1.5  # timed passes
    assert m["costs_ms"]["v"]["1"] > 0 and m["costs_ms"]["draft_token"] > 0
    assert m["verdict"].startswith(("a draft can pay here", "a draft cannot"))
    assert "weights" in m["memory_plan"]
    assert m["slots"]["n_max"] == 4 and m["slots"]["note"] == "" and "possible" in m["slots"]["batch_requests"]
    assert set(m["slots"]["prefill_pieces"]) == {"target", "draft"}  # each model's long prompts beside others


def setup_in_empty_checkout(tmp_path: Path, python: str) -> tuple[int, str]:
    """setup.sh in a checkout with no .venv yet, with PYTHON=python."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text(SETUP.read_text())
    env = {**os.environ, "PYTHON": python, "CMAKE_ARGS": "-DGGML_METAL=off"}
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=30, cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("python, says", [
    ("python3.0-not-installed", "'python3.0-not-installed' is not on PATH"),
    ('case "$1" in -V) echo "Python 3.9.6";; *) exit 1;; esac', "is Python 3.9.6"),
    ('case "$2" in *venv*) exit 1;; *) exit 0;; esac', "no venv module"),
])
def test_setup_names_a_missing_python_before_anything_else(tmp_path, python, says):
    if python.startswith("case"):
        stand_in(tmp_path, "python-stand-in", python)
        python = str(tmp_path / "python-stand-in")
    code, out = setup_in_empty_checkout(tmp_path, python)
    assert code == 1 and says in out, out
    assert not (tmp_path / ".venv").exists()  # nothing made or downloaded first


def test_setup_names_a_missing_compiler_before_compiling():
    check = SETUP.read_text().split("check_compiler() {", 1)[1].split("\n}\n", 1)[0]
    done = subprocess.run(["bash", "-c", f"check_compiler() {{{check}\n}}\nPATH=/nonexistent check_compiler"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "needs a C/C++ compiler" in done.stderr and "build-essential" in done.stderr
