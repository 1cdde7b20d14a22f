#!/usr/bin/env python3
"""Write tiny random-weight GGUF models of the 2026 architectures no PyPI package ships.

No hybrid (gated delta net + attention) or MTP GGUF small enough for tests exists on PyPI, so
the tests build their own with the gguf package: a few MB of random weights, with the
hyperparameter keys and tensor names llama.cpp's loaders read (vendor/llama.cpp
src/models/qwen35.cpp and src/models/qwen3.cpp). Random weights are enough to test exactness
and the mechanics of rollback; they say nothing about speed on real models.

The tokenizer (every tokenizer.* key) is copied from a real GGUF, so the tiny models share
its vocabulary and pass llama.cpp's draft-compatibility rules with each other and with it.

    hybrid     qwen35: 3 gated-delta-net layers + 1 attention layer, optionally 1 MTP (nextn) block
    attention  qwen3: 2 attention layers, the same token embedding as the hybrid

A "perturbed copy" (perturb > 0) adds noise to every weight but the token embedding, so that a
copy drafting for the original agrees on part of its tokens, as a real draft does.

Usage: python scripts/tiny_models.py TOKENIZER.gguf OUT_DIR   (writes the set the tests use)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import gguf
import numpy as np

N_EMBD = 64
N_FF = 128
N_HEAD, N_HEAD_KV, HEAD_DIM = 2, 1, 32
N_ROT, ROPE_SECTIONS = 16, [4, 2, 2, 0]  # interleaved MRoPE: the sections add up to n_rot / 2
SSM_STATE, SSM_GROUPS, SSM_V_HEADS, SSM_CONV = 16, 2, 4, 4  # gated delta net: head dim, k heads, v heads
# the gain of the projections back into the residual stream: how far the layers move the next
# token from the embedding's successor s(x), and so how often two models of the set disagree
RESIDUAL = 0.2
N_TRUNK = 4  # layers 0-2 recurrent, layer 3 attention (full_attention_interval 4)


def tokenizer_fields(path: Path) -> list[tuple[str, object, gguf.GGUFValueType, Optional[gguf.GGUFValueType]]]:
    """Every tokenizer.* key of a GGUF, as (key, value, type, array element type)."""
    reader = gguf.GGUFReader(path)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[1] if main == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), main, sub))
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, fields) -> None:
    for key, value, main, sub in fields:
        writer.add_key_value(key, value, main, sub_type=sub)


class _Weights:
    """Random tensors from one seed; perturbed copies add noise from a second one."""

    def __init__(self, seed: int, perturb: float, perturb_seed: int):
        self.rng = np.random.default_rng(seed)
        self.noise = np.random.default_rng(perturb_seed)
        self.perturb = perturb

    def __call__(self, *shape: int, scale: float = 1.0, offset: float = 0.0, exact: bool = False) -> np.ndarray:
        w = offset + scale * self.rng.standard_normal(shape)
        if self.perturb and not exact:
            w = w + self.perturb * scale * self.noise.standard_normal(shape)
        return w.astype(np.float32)


def _output_head(embd: np.ndarray, w: _Weights) -> np.ndarray:
    """The embedding through a fixed rotation: with small layer outputs, every model of the set
    continues token x with roughly the same successor s(x) (not x itself, as a tied head
    would), and their layers decide the rest, so drafts agree on part of the tokens."""
    rotation, _ = np.linalg.qr(w(N_EMBD, N_EMBD, exact=True))
    return _q8(embd @ rotation)


def _put(writer: gguf.GGUFWriter, name: str, tensor: np.ndarray) -> None:
    quantized = tensor.dtype == np.uint8  # from _q8
    writer.add_tensor(name, tensor, raw_dtype=gguf.GGMLQuantizationType.Q8_0 if quantized else None)


def _norm(w: _Weights, n: int) -> np.ndarray:
    return w(n, scale=0.1, offset=1.0)


def _mat(w: _Weights, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
    return _q8(w(n_out, n_in, scale=gain / np.sqrt(n_in)))


def _q8(weights: np.ndarray) -> np.ndarray:
    # Q8_0, as a quantized GGUF: llama.cpp's CPU kernels quantize the activations the same way
    # for one token and for a small batch, so batches can give single-token rows bit for bit
    # (F16 and F32 weights take other kernels for batches and differ by rounding)
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)


def _attention(writer: gguf.GGUFWriter, w: _Weights, il: int, gated_q: bool, residual: float = RESIDUAL) -> None:
    blk = f"blk.{il}"
    _put(writer, f"{blk}.attn_q.weight", _mat(w, HEAD_DIM * N_HEAD * (2 if gated_q else 1), N_EMBD))
    _put(writer, f"{blk}.attn_k.weight", _mat(w, HEAD_DIM * N_HEAD_KV, N_EMBD))
    _put(writer, f"{blk}.attn_v.weight", _mat(w, HEAD_DIM * N_HEAD_KV, N_EMBD))
    _put(writer, f"{blk}.attn_output.weight", _mat(w, N_EMBD, HEAD_DIM * N_HEAD, residual))
    _put(writer, f"{blk}.attn_q_norm.weight", _norm(w, HEAD_DIM))
    _put(writer, f"{blk}.attn_k_norm.weight", _norm(w, HEAD_DIM))


def _ffn(writer: gguf.GGUFWriter, w: _Weights, il: int, residual: float = RESIDUAL) -> None:
    _put(writer, f"blk.{il}.ffn_gate.weight", _mat(w, N_FF, N_EMBD))
    _put(writer, f"blk.{il}.ffn_up.weight", _mat(w, N_FF, N_EMBD))
    _put(writer, f"blk.{il}.ffn_down.weight", _mat(w, N_EMBD, N_FF, residual))


def _delta_net(writer: gguf.GGUFWriter, w: _Weights, il: int) -> None:
    blk = f"blk.{il}"
    key_dim, value_dim = SSM_STATE * SSM_GROUPS, SSM_STATE * SSM_V_HEADS
    _put(writer, f"{blk}.attn_qkv.weight", _mat(w, 2 * key_dim + value_dim, N_EMBD))
    _put(writer, f"{blk}.attn_gate.weight", _mat(w, value_dim, N_EMBD))
    _put(writer, f"{blk}.ssm_conv1d.weight", w(2 * key_dim + value_dim, SSM_CONV, scale=0.5))
    _put(writer, f"{blk}.ssm_dt.bias", w(SSM_V_HEADS, scale=0.5))
    _put(writer, f"{blk}.ssm_a", -np.exp(w(SSM_V_HEADS, scale=0.5)))  # A = -exp(A_log), as converted
    _put(writer, f"{blk}.ssm_beta.weight", _mat(w, SSM_V_HEADS, N_EMBD))
    _put(writer, f"{blk}.ssm_alpha.weight", _mat(w, SSM_V_HEADS, N_EMBD))
    _put(writer, f"{blk}.ssm_norm.weight", _norm(w, SSM_STATE))
    _put(writer, f"{blk}.ssm_out.weight", _mat(w, N_EMBD, value_dim, RESIDUAL))


def _common(writer: gguf.GGUFWriter, n_layer: int, name: str) -> None:
    writer.add_name(name)
    writer.add_context_length(4096)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)


def write_hybrid(fields: list, path: Path, *, mtp: bool = False, seed: int = 0, perturb: float = 0.0,
                 perturb_seed: int = 1) -> Path:
    """A qwen35 hybrid: 3 gated-delta-net layers and 1 attention layer, plus an MTP block."""
    n_vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    w = _Weights(seed, perturb, perturb_seed)
    writer = gguf.GGUFWriter(str(path), "qwen35")
    _common(writer, N_TRUNK + (1 if mtp else 0), f"tiny-qwen35{'-mtp' if mtp else ''}")
    writer.add_rope_dimension_count(N_ROT)
    writer.add_rope_dimension_sections(ROPE_SECTIONS)
    writer.add_ssm_conv_kernel(SSM_CONV)
    writer.add_ssm_inner_size(SSM_STATE * SSM_V_HEADS)
    writer.add_ssm_state_size(SSM_STATE)
    writer.add_ssm_time_step_rank(SSM_V_HEADS)
    writer.add_ssm_group_count(SSM_GROUPS)
    writer.add_full_attention_interval(N_TRUNK)
    if mtp:
        writer.add_nextn_predict_layers(1)
    _add_tokenizer(writer, fields)
    # embedding and output head are shared by every model of the set, so perturbed copies
    # differ in their layers only
    embd = w(n_vocab, N_EMBD, exact=True)
    _put(writer, "token_embd.weight", _q8(embd))
    _put(writer, "output.weight", _output_head(embd, w))
    _put(writer, "output_norm.weight", _norm(w, N_EMBD))
    for il in range(N_TRUNK):
        _put(writer, f"blk.{il}.attn_norm.weight", _norm(w, N_EMBD))
        _put(writer, f"blk.{il}.post_attention_norm.weight", _norm(w, N_EMBD))
        if (il + 1) % N_TRUNK:
            _delta_net(writer, w, il)
        else:
            _attention(writer, w, il, gated_q=True)
        _ffn(writer, w, il)
    if mtp:
        il = N_TRUNK
        _put(writer, f"blk.{il}.attn_norm.weight", _norm(w, N_EMBD))
        _put(writer, f"blk.{il}.post_attention_norm.weight", _norm(w, N_EMBD))
        _attention(writer, w, il, gated_q=True)
        _ffn(writer, w, il)
        # the head sees [embedding of x, target hidden state]: passing the embedding through
        # makes it predict roughly s(x), as the target does, so MTP drafts are partly right
        eh_proj = np.concatenate([np.eye(N_EMBD), w(N_EMBD, N_EMBD, scale=RESIDUAL / np.sqrt(N_EMBD))], axis=1)
        _put(writer, f"blk.{il}.nextn.eh_proj.weight", _q8(eh_proj.astype(np.float32)))
        _put(writer, f"blk.{il}.nextn.enorm.weight", _norm(w, N_EMBD))
        _put(writer, f"blk.{il}.nextn.hnorm.weight", _norm(w, N_EMBD))
    _finish(writer)
    return path


def write_attention(fields: list, path: Path, *, seed: int = 0, perturb: float = 0.0,
                    perturb_seed: int = 2, n_layer: int = 2, residual: float = RESIDUAL) -> Path:
    """A qwen3 attention-only model with the hybrid's token embedding (same seed). More layers
    with a smaller residual gain make a pass cost what its layers' dispatch costs, whatever its
    rows: a stand-in for a GPU, where a verify of several rows costs about one."""
    n_vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    w = _Weights(seed, perturb, perturb_seed)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    _common(writer, n_layer, "tiny-qwen3")
    _add_tokenizer(writer, fields)
    embd = w(n_vocab, N_EMBD, exact=True)
    _put(writer, "token_embd.weight", _q8(embd))
    _put(writer, "output.weight", _output_head(embd, w))
    _put(writer, "output_norm.weight", _norm(w, N_EMBD))
    for il in range(n_layer):
        _put(writer, f"blk.{il}.attn_norm.weight", _norm(w, N_EMBD))
        _put(writer, f"blk.{il}.ffn_norm.weight", _norm(w, N_EMBD))
        _attention(writer, w, il, gated_q=False, residual=residual)
        _ffn(writer, w, il, residual=residual)
    _finish(writer)
    return path


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# The set the tests use: name -> (writer, keyword arguments).
SET = {
    "hybrid-target": (write_hybrid, dict(mtp=True)),
    "hybrid-draft": (write_hybrid, dict(perturb=0.3)),
    "attention-draft": (write_attention, dict()),
    # a perturbed copy of attention-draft: a draft that agrees on most of its tokens, not all
    "attention-perturbed": (write_attention, dict(perturb=0.05)),
}


def write_set(tokenizer: Path, out_dir: Path) -> dict[str, Path]:
    """Write (or reuse) every model of SET in out_dir; name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, fields = {}, None
    for name, (write, kwargs) in SET.items():
        path = out_dir / f"tiny-{name}.gguf"
        if not path.exists():
            partial = path.with_suffix(".partial")
            fields = fields or tokenizer_fields(tokenizer)
            write(fields, partial, **kwargs)
            partial.rename(path)
        paths[name] = path
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    for name, path in write_set(Path(sys.argv[1]), Path(sys.argv[2])).items():
        print(f"{name}\t{path}")
