"""Memory planning from real GGUF headers."""

from __future__ import annotations

import os
import re

import pytest

import specllama
from specllama.models import gguf_check, plan
from specllama.models.plan import GiB, MemoryPlanError
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


def test_llama_cpp_reports_its_devices_and_their_memory():
    from specllama.runtime import devices

    found = devices()
    cpu = [d for d in found if d.kind == "cpu"]
    assert len(cpu) == 1, found
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu[0].total == pytest.approx(physical, rel=0.01)
    assert 0 < cpu[0].free <= cpu[0].total
    discrete, _, names = plan.gpu_memory()
    assert (discrete is None) == (not any(d.discrete for d in found))
    assert len(names) == sum(d.kind in ("gpu", "igpu") for d in found)


def test_a_gpu_too_small_suggests_a_layer_count_that_fits(model_paths):
    target, draft = model_paths["target"], model_paths["draft"]
    roomy = plan.make_plan(target, draft, settings(), gpu_offload=True, available=64 * GiB,
                           available_gpu=64 * GiB)
    assert roomy.fits and roomy.needed_gpu == roomy.target.gpu + roomy.draft.gpu > 0
    assert roomy.target.ram < roomy.target.weights_gpu  # only the token embeddings stay behind
    gpu_free = roomy.needed_gpu - roomy.target.gpu // 3
    tight = plan.make_plan(target, draft, settings(), gpu_offload=True, available=64 * GiB,
                           available_gpu=gpu_free)
    assert not tight.fits and tight.needed_ram <= tight.available_ram
    with pytest.raises(MemoryPlanError) as info:
        plan.check(tight, 4096)
    message = str(info.value)
    assert "of GPU memory" in message and "draft_n_gpu_layers=0" in message
    n_layers = int(re.search(r"n_gpu_layers=(\d+) \(of (\d+)\)", message).group(1))
    assert 0 < n_layers < tight.target.n_layer
    suggested = plan.make_plan(target, draft, settings(n_gpu_layers=n_layers), settings(), gpu_offload=True,
                               available=64 * GiB, available_gpu=gpu_free)
    assert suggested.fits, suggested.describe()
    assert suggested.target.n_offloaded == n_layers and suggested.draft.n_offloaded == suggested.draft.n_layer


def test_unified_memory_counts_offloaded_weights_once_in_one_pool():
    m = plan.ModelPlan("m", weights_ram=1 * GiB, weights_gpu=4 * GiB, kv=2 * GiB, compute=GiB // 2,
                       n_layer=10, n_offloaded=5)
    assert (m.kv_gpu, m.gpu, m.ram) == (GiB, 4 * GiB + GiB + GiB // 2, 1 * GiB + GiB)
    unified = plan.MemoryPlan(m, m, available_ram=14 * GiB, unified_memory=True, available_gpu=0)
    assert unified.needed_ram == 2 * m.total == 15 * GiB and unified.needed_gpu == 0
    assert not unified.fits
    ways = plan.ways_out(unified, 4096)
    assert not any("draft_n_gpu_layers" in w for w in ways)  # one pool: moving the draft saves nothing
    assert ways[-1] == "(short by 1.00 GiB of RAM)"
    discrete = plan.MemoryPlan(m, m, available_ram=4 * GiB, unified_memory=False, available_gpu=11 * GiB)
    assert discrete.needed_ram == 4 * GiB and discrete.needed_gpu == 11 * GiB and discrete.fits
    discrete.available_gpu -= 1
    assert not discrete.fits and discrete.gpu_short == 1


def test_load_measures_the_memory_each_model_takes(model_paths):
    from specllama.runtime import resident_bytes

    header_bytes = {name: sum(t.n_bytes for t in gguf_check.read_header(model_paths[name]).tensors)
                    for name in ("target", "draft")}
    before = resident_bytes()
    llm = specllama.load(model_paths["target"], model_paths["draft"], n_draft=2, n_ctx=2048, n_threads=2)
    try:
        stats = llm.generate("def add(a, b):", max_tokens=4).stats
    finally:
        llm.close()
    after_close = resident_bytes()
    # mapped weights are read in at load, so each model's figure holds at least its weights
    assert stats.n_bytes_target >= 0.9 * header_bytes["target"]
    assert stats.n_bytes_draft >= 0.9 * header_bytes["draft"]
    assert stats.n_bytes_target > stats.n_bytes_draft
    assert stats.draft_memory_share == pytest.approx(
        stats.n_bytes_draft / (stats.n_bytes_target + stats.n_bytes_draft))
    assert stats.n_bytes_resident - before >= 0.95 * (stats.n_bytes_target + stats.n_bytes_draft)
    assert "GiB resident (draft" in stats.summary()
    # close() gives the memory back
    assert stats.n_bytes_resident - after_close >= 0.8 * (stats.n_bytes_target + stats.n_bytes_draft)
    # and the plan made from the headers is within a factor of two of what loading took
    estimate = plan.make_plan(model_paths["target"], model_paths["draft"], settings(n_ctx=2048))
    for planned, measured in ((estimate.target.total, stats.n_bytes_target),
                              (estimate.draft.total, stats.n_bytes_draft)):
        assert 0.5 < measured / planned < 2.0


def test_batch_requests_plans_the_lanes_kv_caches(model_paths):
    """With batch_requests the shared contexts hold n_parallel lanes of n_ctx tokens beside the
    first contexts: the plan counts their KV caches for both models."""
    alone = plan.make_plan(model_paths["target"], model_paths["draft"], settings(n_ctx=4096))
    lanes = plan.make_plan(model_paths["target"], model_paths["draft"], settings(n_ctx=4096), n_lanes=4)
    for a, b in zip(alone.models, lanes.models):
        assert b.kv == 5 * a.kv and b.compute == 2 * a.compute
    assert lanes.needed_ram > alone.needed_ram
