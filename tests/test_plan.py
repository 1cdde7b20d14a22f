"""Memory planning from real GGUF headers."""

from __future__ import annotations

import pytest

import specllama
from specllama import gguf_check, plan
from specllama.plan import MemoryPlanError
from specllama.runtime import ModelSettings


def settings(**kw) -> ModelSettings:
    return ModelSettings(**{"n_ctx": 4096, "n_gpu_layers": -1, **kw})


def test_kv_and_weights_follow_the_header(model_paths):
    path = model_paths["target"]
    f = gguf_check.read_header(path).fields
    n_layer, n_head_kv = f["qwen2.block_count"], f["qwen2.attention.head_count_kv"]
    head_dim = f["qwen2.embedding_length"] // f["qwen2.attention.head_count"]
    m = plan.model_plan(path, settings())
    assert m.kv == n_layer * 4096 * n_head_kv * head_dim * 2 * 2  # K and V, f16
    header = gguf_check.read_header(path)
    assert m.weights_ram == sum(t.n_bytes for t in header.tensors)
    assert m.weights_ram + header.data_offset <= path.stat().st_size
    q8 = plan.model_plan(path, settings(type_k="q8_0", type_v="q8_0"))
    assert q8.kv == pytest.approx(m.kv * 34 / 64, rel=1e-3)


def test_offloaded_layers_are_split_out(model_paths):
    path = model_paths["target"]
    all_gpu = plan.model_plan(path, settings(), gpu_offload=True)
    half = plan.model_plan(path, settings(n_gpu_layers=14), gpu_offload=True)
    cpu = plan.model_plan(path, settings(), gpu_offload=False)
    assert cpu.weights_gpu == 0
    assert 0 < half.weights_gpu < all_gpu.weights_gpu
    assert half.weights_ram + half.weights_gpu == cpu.weights_ram


def test_does_not_fit_lists_ways_out_cheapest_first(model_paths):
    memory = plan.make_plan(model_paths["target"], model_paths["draft"], settings(n_ctx=8192), available=1024 ** 3)
    assert not memory.fits
    with pytest.raises(MemoryPlanError) as info:
        plan.check(memory, 8192)
    message = str(info.value)
    order = [message.index(s) for s in ("n_ctx=2048", "q8_0", "smaller draft", "draft='ngram'")]
    assert order == sorted(order)
    assert "draft qwen2.5-coder-0.5b" in message and "short by" in message


def test_load_refuses_before_loading(model_paths, monkeypatch):
    monkeypatch.setattr(plan, "available_memory", lambda: (512 * 1024 ** 2, False))
    with pytest.raises(MemoryPlanError, match="do not fit"):
        specllama.load(model_paths["target"], model_paths["draft"], n_ctx=2048)


def test_plan_with_room_fits(model_paths):
    memory = plan.make_plan(model_paths["target"], model_paths["draft"], settings(n_ctx=2048),
                            available=64 * 1024 ** 3)
    assert memory.fits and 0 < memory.draft.total < memory.target.total


def test_the_draft_is_planned_with_its_own_settings(model_paths):
    shared = plan.make_plan(model_paths["target"], model_paths["draft"], settings())
    own = plan.make_plan(model_paths["target"], model_paths["draft"], settings(),
                         settings(type_k="q8_0", type_v="q8_0", n_ctx=1024))
    assert own.target.kv == shared.target.kv
    assert own.draft.kv == pytest.approx(shared.draft.kv * 34 / 64 / 4, rel=1e-3)
