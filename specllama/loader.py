"""load(): a target and an optional draft from paths, Hub references, aliases or Llama objects."""

from __future__ import annotations

import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Union

from .caching.disk_cache import DISK_MB, check as check_disk
from .doctor import offload_note
from .models.draft_select import MTP
from .engine import N_PARALLEL, PROMPT_CACHE_MB, SpecLlama, check_cache_mb, check_n_parallel
from .measuring.idle import PROCESS
from .errors import InvalidParameterError
from .measuring.fidelity import parse_level
from .decoding.limits import TREE_BRANCHES
from .options import check_n_draft
from .models.plan import MemoryPlan, check as check_plan, make_plan, plan_lanes
from .runtime import ModelSettings
from .runtime.ggml import supports_gpu_offload
from .runtime.core import open_runtime
from .runtime.remote import RemoteRuntime
from .scheduling.sharing import AUTO

log = logging.getLogger("specllama")

SETTING_NAMES = {f.name for f in fields(ModelSettings)}
# settings that describe the target's placement or role, which the draft does not inherit
_TARGET_ONLY = ("rpc", "tensor_split", "rollback")


def load(target: Any, draft: Any = None, *, n_draft: Union[int, str] = "auto",
         exact: Union[str, float, bool] = "rounding",
         lookup: Optional[bool] = None, check_memory: bool = True, prompt_cache_mb: float = PROMPT_CACHE_MB,
         tree: Union[int, str, bool] = "auto", idle_work: Optional[bool] = None, n_parallel: int = N_PARALLEL,
         batch_requests: Union[bool, str] = False, prompt_cache_dir: Optional[Union[str, os.PathLike]] = None,
         prompt_cache_disk_mb: float = DISK_MB, **model_settings: Any) -> SpecLlama:
    """Load a target model and an optional draft of the same family.

    Args:
        target: a GGUF path, a Hub repo id ("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m"), a
            models.toml alias, or a llama_cpp.Llama you built (its settings are kept).
        draft: the same kinds, "auto" to find a same-family draft (the target's own MTP
            layers first, where its GGUF has them), "mtp" for those layers, "ngram" for prompt
            lookup alone (no second model), or None for plain decoding.
        n_draft: "auto" (default: each round drafts as far as the measured costs and the
            acceptance so far say pays, and not at all when nothing beats plain decoding), or
            a fixed number of tokens per round (0..32).
        lookup: prompt lookup (n-grams of prompt + output) as a source of drafts. None
            (default): in auto mode, weighed beside the draft model every round; True: also
            with a fixed n_draft (first on long matches) or with no draft model; False: never.
        tree: "auto" (default): in auto mode a round may verify, beside each drafted token,
            up to 2 next-best draft tokens and prompt lookup's continuation, as a tree in one
            target pass, where the measured cost of verify rows says it pays. An integer w:
            that many candidates per drafted position (with a fixed n_draft: at every one).
            1: chains only. Trees need an attention-only target on this machine.
        prompt_cache_mb: RAM for saved prompt-cache states (MiB, target and draft together).
        prompt_cache_dir: a folder where prompt-cache states outlive the process (off when
            None): long prompts, states evicted from RAM and the live conversation at close()
            are written there, and a later load() of the same model files, build and context
            settings reuses them; keyed by the files' content, so nothing else is ever restored.
        prompt_cache_disk_mb: that folder's byte budget (MiB), least recently used out first.
        check_memory: plan the memory both models need from their GGUF headers and raise
            MemoryPlanError (with ways out) before loading when it exceeds what is available.
        idle_work: measurements a request found missing (verify limits at a new KV length,
            decode costs, the reuse difference) and the draft catching up with a conversation
            run in a background thread while no generation runs; False: only in warm_up(); None
            (the default): on, unless the environment has SPECLLAMA_IDLE_WORK=0.
        n_parallel: how many requests may decode side by side (default 4, as llama-server's
            slots), each in contexts of its own on the shared weights, made when first needed
            (a KV cache and compute buffers each); their rounds take turns, so each request's
            output is the one it has alone. Further requests wait for a free slot.
        batch_requests: also make one target context of n_parallel lanes, where requests at
            a level that allows it (not bitwise, not seeded) decode side by side with their
            rows in one llama_decode per round (sharing.py); n_parallel x n_ctx KV cells, and
            a probe of a few seconds at the first load (cached). "auto" (`specllama serve`'s
            default): only where requests at this load's level can use them (the difference a
            lane's rows carry is within its bound) and memory allows; else requests take turns
            and the log and /health say why.
        exact: the fidelity level: "bitwise", "rounding" (default), "off", a bound in logits,
            or True/False for "bitwise"/"off" (see fidelity.py).
        **model_settings: ModelSettings' fields for both models (n_ctx, n_batch, n_threads,
            n_threads_batch, n_gpu_layers, flash_attn, type_k, type_v, use_mmap, verbose, rpc,
            tensor_split, rpc_timeout, rollback); prefix one with draft_ for the draft alone
            (e.g. draft_n_gpu_layers=0). rpc, tensor_split and rollback are the target's.
    Returns:
        A SpecLlama; close() it or use it in a with-block.
    """
    target_kw = {k: v for k, v in model_settings.items() if not k.startswith("draft_")}
    # the draft stays on this machine unless draft_rpc says otherwise
    draft_kw = {**{k: v for k, v in target_kw.items() if k not in _TARGET_ONLY},
                **{k[6:]: v for k, v in model_settings.items() if k.startswith("draft_")}}
    # a draft decodes one token at a time, which per-batch snapshots (n_rs_seq) cannot undo
    draft_kw.setdefault("rollback", "checkpoint")
    for key in set(target_kw) | set(draft_kw):
        if key not in SETTING_NAMES:
            raise TypeError(f"load() got an unknown setting {key!r}; known: {', '.join(sorted(SETTING_NAMES))}")
    check_n_draft(n_draft)
    parse_level(exact)
    check_cache_mb(prompt_cache_mb)
    if prompt_cache_dir is not None:  # before anything loads: a folder that cannot be written is a typo
        check_disk(prompt_cache_dir, prompt_cache_disk_mb)
    check_n_parallel(n_parallel)
    if not isinstance(batch_requests, bool) and batch_requests != AUTO:
        raise InvalidParameterError("batch_requests", batch_requests, 'True, False or "auto"')
    if draft == "ngram":
        draft, lookup = None, True
    target_settings, draft_settings = ModelSettings(**target_kw), ModelSettings(**draft_kw)
    for role, model, settings in (("", target, target_settings), ("draft_", draft, draft_settings)):
        if settings.rpc and not _is_ref(model):
            raise InvalidParameterError(f"{role}rpc", settings.rpc, "used with a GGUF path or a Hub reference; a "
                                        "llama_cpp.Llama keeps the devices it was built with")
    note = offload_note(target_settings.n_gpu_layers) if not target_settings.rpc else None
    if note is not None:
        log.info(note)
    if _is_ref(target) and (draft is None or _is_ref(draft)):
        from .models.draft_select import resolve_pair

        target, draft, notes = resolve_pair(str(target), None if draft is None else str(draft))
        for note in notes:
            log.info(note)
    opened: list[Any] = []  # what to close if loading fails part way
    no_lanes = ""  # why "auto" made no lanes, where the memory plan decided
    try:
        # a model on RPC workers is hosted by a process of its own, which reports their memory
        target_host = _rpc_host(target_settings, opened)
        draft_host = _rpc_host(draft_settings, opened) if draft is not None else None
        if check_memory and _is_ref(target) and (draft is None or _is_ref(draft)):
            def plan(n_lanes: int) -> MemoryPlan:
                return make_plan(Path(target), Path(draft) if draft not in (None, MTP) else None, target_settings,
                                 draft_settings, gpu_offload=supports_gpu_offload(),
                                 target_devices=target_host.devices if target_host else None,
                                 draft_devices=draft_host.devices if draft_host else None,
                                 prompt_cache=check_cache_mb(prompt_cache_mb), n_lanes=n_lanes)

            memory, n_lanes = plan_lanes(plan, n_parallel if batch_requests else 0, required=batch_requests is True)
            if batch_requests == AUTO and not n_lanes:
                no_lanes = f"lanes for {n_parallel} requests do not fit in the memory free now"
                log.info("requests take turns in contexts of their own: %s", no_lanes)
                batch_requests = False
            check_plan(memory, target_settings.n_ctx)
        mtp = draft == MTP
        if mtp and (target_host is not None or not _is_ref(target)):
            raise InvalidParameterError("draft", draft, "used with a GGUF path or Hub reference on this machine; "
                                        "a llama_cpp.Llama or a target on RPC workers cannot load its MTP layers")
        with PROCESS.busy():  # no idle work of another SpecLlama decodes while llama.cpp loads
            target_rt = target_host.load(target) if target_host else \
                open_runtime(target, target_settings, mtp=mtp, n_branches=TREE_BRANCHES)
            opened.append(target_rt)
            draft_rt = None
            if mtp:  # a local Runtime (checked above), which may carry its MTP layers
                draft_rt = target_rt.mtp_head
                if draft_rt is None:
                    log.warning("%s: %s; decoding without a draft", target_rt.name, target_rt.mtp_note)
            elif draft is not None:
                draft_rt = draft_host.load(draft) if draft_host else open_runtime(draft, draft_settings)
                opened.append(draft_rt)
        llm = SpecLlama(target_rt, draft_rt, n_draft=n_draft, exact=exact, lookup=lookup,
                        prompt_cache_mb=prompt_cache_mb, tree=tree, idle_work=idle_work,
                        n_parallel=n_parallel, batch_requests=batch_requests, prompt_cache_dir=prompt_cache_dir,
                        prompt_cache_disk_mb=prompt_cache_disk_mb)
        llm.sharing_note = llm.sharing_note or no_lanes  # what /health shows
        return llm
    except BaseException:
        for handle in reversed(opened):
            handle.close()
        raise


def _rpc_host(settings: ModelSettings, opened: list) -> Optional[RemoteRuntime]:
    if not settings.rpc:
        return None
    host = RemoteRuntime(settings)
    opened.append(host)
    return host


def _is_ref(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike))

