"""What this llama.cpp build is and can do here, and, for a model, whether a draft can pay.

`specllama doctor [MODEL]` prints these; load() logs offload_note() so a build that cannot use
the machine's GPU is never a silent CPU run.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Optional

from . import runtime

if TYPE_CHECKING:
    from .runtime.core import Runtime
from .measuring import records
from .measuring.calibrate import apart_key, calibrate_fidelity, fidelity_key, piece_key
from .controller import OnlineCosts, draft_can_pay
from .controller.costs import ideal_speedup
from .measuring.fidelity import LEVELS, group_label, kv_group
from .decoding.limits import MAX_VERIFY
from .scheduling.sharing import why_not_shared

REBUILD = ("bash scripts/setup.sh (it picks Metal or CUDA for the machine), or in your own environment "
           "CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36")


def hardware_gpus() -> list[str]:
    """GPUs this machine has, whatever llama.cpp was built with: the Apple GPU on Apple silicon,
    NVIDIA cards as nvidia-smi lists them."""
    found = []
    if sys.platform == "darwin" and platform.machine() == "arm64":
        found.append("Apple Silicon GPU (Metal)")
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        found += [line.strip() for line in listing.splitlines() if line.startswith("GPU")]
    return found


def offload_note(n_gpu_layers: int) -> Optional[str]:
    """The line to log when n_gpu_layers asks for GPU offload that this build cannot do: an
    explicit layer count, or the default "all" on a machine that has a GPU."""
    if n_gpu_layers == 0 or runtime.supports_gpu_offload():
        return None
    gpus = hardware_gpus()
    if n_gpu_layers > 0 or gpus:
        where = f"this machine has {gpus[0]}, but " if gpus else ""
        return (f"n_gpu_layers={n_gpu_layers} asks for GPU offload, but {where}this llama.cpp build has only the "
                f"{', '.join(runtime.backends())} backend, so every layer runs on the CPU; rebuild with {REBUILD}")
    return None


def system_report() -> dict:
    """The build, its backends and devices, and whether it can use this machine's GPU."""
    gpus, offload = hardware_gpus(), runtime.supports_gpu_offload()
    warnings = []
    if gpus and not offload:
        warnings.append(f"this machine has {gpus[0]} but this llama.cpp build cannot use it "
                        f"(backends: {', '.join(runtime.backends())}); rebuild with {REBUILD}")
    return {"llama_cpp": runtime.build_info(), "backends": runtime.backends(),
            "devices": [dataclasses.asdict(d) for d in runtime.devices()], "gpu_offload": offload,
            "rpc": runtime.supports_rpc(), "hardware_gpus": gpus, "warnings": warnings}


def model_report(llm: Any, n_groups: int = 3) -> dict:
    """Fidelity per KV length, decode costs and the verdict on the draft of a loaded SpecLlama,
    each with when and how it was measured (cached measurements; the first call measures,
    which prefills up to about 600 tokens)."""
    target, draft = llm.target, llm.draft
    with llm.exclusive():
        fidelity = calibrate_fidelity(target, n_groups)
        costs = llm.planner.book.get(measure=True)
        memory = memory_report(target)
    assert costs is not None  # measured just now
    rows = [{"kv": group_label(kv_group(f.n_kv)), "n_kv": f.n_kv, "max_diff": max(f.diffs, default=0.0),
             "measured": records.describe(records.read(fidelity_key(target, kv_group(f.n_kv)))),
             **{f"max_verify_{name}": f.largest_batch(LEVELS[name].bound) for name in ("bitwise", "rounding")},
             "verify_ms": {n: round(f.verify_seconds[n - 1] * 1000, 1) for n in (1, 4) if len(f.verify_seconds) >= n}}
            for f in fidelity]
    k_max = min(fidelity[0].largest_batch(LEVELS["rounding"].bound), MAX_VERIFY) - 1
    return {"target": target.name, "draft": draft.name if draft is not None else None,
            "memory": memory, "fidelity": rows,
            "rounding_bound": LEVELS["rounding"].bound,
            "costs_ms": {"v": {n: round(costs.v(n) * 1000, 1) for n in (1, 2, 3, 4, 8, 16)},
                         "draft_token": round(costs.draft_token * 1000, 1),
                         **({"draft_token_after_kv": {costs.draft_kv[0]: round(costs.draft_kv[1] * 1000, 1)}}
                            if costs.draft_kv else {})},
            "costs_measured": records.describe(llm.planner.book.record),
            "verdict": verdict(costs, k_max, draft is not None),
            "slots": {"n_max": llm.pool.slots.n_max, "note": llm.pool.slots.note,
                      "batch_requests": sharing_report(llm), "prefill_pieces": pieces_report(llm)}}


def pieces_report(llm: Any) -> dict:
    """Per model, how a long prompt prefills beside other requests: the piece probe's difference
    (concurrency_probes.py; None until measured) and when it was measured."""
    out = {}
    for role, model in (("target", llm.target), ("draft", llm.draft)):
        if model is not None and getattr(model, "memory", None) == "attention":
            record = records.read(piece_key(model))
            out[role] = {"diff": None if record is None else float(record["diff"]),
                         "measured": records.describe(record), "n_piece": llm.pool.n_piece(model)}
    return out


def sharing_report(llm: Any) -> dict:
    """Whether requests' rows can share passes here (sharing.py), and at which levels: the lane
    difference as measured at a load with batch_requests (None until one ran)."""
    n_lanes = llm.pool.slots.n_max
    why = why_not_shared(llm.target, llm.draft, n_lanes)
    if why:
        return {"possible": False, "why": why}
    record = records.read(apart_key(llm.target, n_lanes))
    diff = None if record is None else float(record["diff"])
    return {"possible": True, "apart_diff": diff, "measured": records.describe(record),
            "levels": None if diff is None else {name: diff <= LEVELS[name].bound for name in ("bitwise", "rounding")}}


def memory_report(target: "Runtime") -> dict:
    """The target's memory type, how rejected tokens leave it, and its MTP layers."""
    target.truncate(0)
    target.decode(target.tokenize("The size of one state", add_special=False))
    n_checkpoint = target.checkpoint_bytes  # a recurrent state's size does not grow with the text
    target.truncate(0)
    return {"type": target.memory, "rollback": target.rollback, "n_rs_seq": target.n_rs_seq,
            "checkpoint_bytes": n_checkpoint, "mtp_layers": target.n_nextn,
            "mtp_loaded": target.mtp_head is not None, "tree_branches": target.n_branches}


def describe_memory(m: dict) -> list[str]:
    """Three lines for `specllama doctor`: the rollback a model gets, its MTP heads, and
    whether verify batches may be trees."""
    rollback = {
        "seq_rm": "seq_rm (rejected tokens leave the KV cache for free)",
        "n_rs_seq": f"n_rs_seq ({m['n_rs_seq']} per-token snapshots of the recurrent state; a "
                    f"{m['checkpoint_bytes'] / 1024:.0f} KiB checkpoint before each batch for whole-batch rollbacks)",
        "checkpoint": f"checkpoint ({m['checkpoint_bytes'] / 1024:.0f} KiB of recurrent state copied before each "
                      "verify batch, restored and the accepted tokens decoded again)",
    }[m["rollback"]]
    kind = {"attention": "attention (KV cache)", "hybrid": "hybrid (recurrent state + KV cache)",
            "recurrent": "recurrent state"}[m["type"]]
    mtp = (f"{m['mtp_layers']} MTP (nextn) layer(s): --draft mtp drafts with them, no second model"
           + ("" if m["mtp_loaded"] else "; --draft auto prefers them") if m["mtp_layers"] else "none")
    trees = (f"yes, up to {m['tree_branches']} branches in one pass (each a sequence in one KV buffer); "
             "the verify limits below cover chains and trees" if m.get("tree_branches", 1) > 1 else
             "no, chains only (" + ("a recurrent state is one per sequence" if m["type"] != "attention"
                                    else "MTP layers follow one sequence") + ")")
    return [f"memory: {kind}; rollback: {rollback}", f"MTP heads: {mtp}", f"tree verify: {trees}"]


def verdict(costs, k_max: int, has_draft: bool) -> str:
    """One line: can a draft pay on this machine at the default fidelity level, and why."""
    v1, v2 = costs.v(1) * 1000, costs.v(2) * 1000
    if not has_draft:
        return "no draft model: only prompt lookup can speculate (it pays where the output copies the input)"
    if k_max <= 0:
        return "a draft cannot run at the rounding level here: no verify batch stays within float rounding"
    if not draft_can_pay(OnlineCosts(costs), k_max):
        return (f"a draft cannot pay here: the target takes {v1:.0f} ms for one token and {v2:.0f} ms to verify "
                f"two, the draft {costs.draft_token * 1000:.0f} ms a token, so even an always-right draft is "
                f"slower than plain decoding; prompt lookup can still pay on edits")
    best = max(ideal_speedup(costs, k) for k in range(1, k_max + 1))
    row = (costs.v(min(6, k_max + 1)) - costs.v(2)) / max(min(6, k_max + 1) - 2, 1) * 1000
    return (f"a draft can pay here: one token costs {v1:.0f} ms and verifying two {v2:.0f} ms, the draft "
            f"{costs.draft_token * 1000:.0f} ms a token; with every draft accepted it would run {best:.1f}x plain "
            f"speed, and real gains follow the acceptance. Each further verify row costs about {row:.0f} ms "
            f"({row / v1:.0%} of a token): a tree's sibling pays where it is picked more often than that")


def print_report(report: dict) -> list[str]:
    """`specllama doctor`'s lines for a system_report (with "model": model_report's, if any)."""
    info = report["llama_cpp"]
    lines = [f"llama-cpp-python {info['llama_cpp_python']}: {info['system_info']}",
             f"backends: {', '.join(report['backends'])}; GPU offload: {'yes' if report['gpu_offload'] else 'no'}; "
             f"RPC workers (--rpc, specllama worker): {'yes' if report['rpc'] else 'no, ' + runtime.NO_RPC_BUILD}"]
    lines += [f"  {d['name']} ({d['kind']}, {d['description']}): {d['free'] / 2**30:.1f} of "
              f"{d['total'] / 2**30:.1f} GiB free" for d in report["devices"]]
    lines.append("GPUs on this machine: " + (", ".join(report["hardware_gpus"]) or "none found"))
    lines += [f"warning: {warning}" for warning in report["warnings"]]
    m = report.get("model")
    if m:
        lines.append(f"\n{m['target']}" + (f" with draft {m['draft']}" if m["draft"] else "") + ":")
        lines.append("  " + m["memory_plan"].replace("\n", "\n  ") + ("" if m["memory_fits"] else "  (does not fit)"))
        lines += [f"  {line}" for line in describe_memory(m["memory"])]
        lines.append(f"  largest verify batch (bitwise / rounding, bound {m['rounding_bound']:g} logits):")
        lines += [f"    {row['kv']:>14}: {row['max_verify_bitwise']:2} / {row['max_verify_rounding']:2}"
                  f"   (largest difference {row['max_diff']:.3g}"
                  + "".join(f"; a pass of {n} row{'s' * (n > 1)} {ms} ms" for n, ms in row["verify_ms"].items())
                  + f"; {row['measured']})" for row in m["fidelity"]]
        v = m["costs_ms"]["v"]
        lines.append("  decode ms by batch size: " + ", ".join(f"{n}: {t}" for n, t in v.items())
                     + (f"; draft {m['costs_ms']['draft_token']} a token" if m["draft"] else "")
                     + "".join(f", {ms} after {n} cached tokens"
                               for n, ms in m["costs_ms"].get("draft_token_after_kv", {}).items())
                     + f" ({m['costs_measured']})")
        lines.append(f"  verdict: {m['verdict']}")
        slots = m.get("slots")
        if slots:
            lines.append(f"  requests at once: one at a time ({slots['note']})" if slots["n_max"] == 1 else
                         f"  requests at once: up to {slots['n_max']} (n_parallel), each in contexts of its own on "
                         "the shared weights (a KV cache and compute buffers more, made when a request needs "
                         "them); their rounds take turns, so each output is the one it has alone")
            lines.append(f"  {_describe_sharing(slots['batch_requests'])}")
            lines += [f"  {_describe_pieces(role, p)}" for role, p in slots["prefill_pieces"].items()]
    return lines


def _describe_pieces(role: str, p: dict) -> str:
    head = f"the {role}'s long prompts beside other requests:"
    if p["diff"] is None:
        return f"{head} whole chunks until pieces are measured (while idle)"
    if p["n_piece"]:
        return (f"{head} in pieces of {p['n_piece']}+ rows, bitwise the whole chunks ({p['measured']}), "
                "so streams beside them go on between pieces"
                + ("; its catch-up while idle goes in pieces too, and a request stops it between two" if role == "draft"
                   else ""))
    return f"{head} whole chunks (pieces differ by {p['diff']:.3g} logits, {p['measured']})"


def _describe_sharing(b: dict) -> str:
    if not b["possible"]:
        return f"rows of requests in one pass (--batch-requests): not here, {b['why']}"
    if b["apart_diff"] is None:
        return ("rows of requests in one pass (--batch-requests): possible; the difference a lane's rows carry "
                "is measured at the first load with it")
    allowed = [name for name, ok in b["levels"].items() if ok]
    return (f"rows of requests in one pass (--batch-requests): a lane's rows differ by {b['apart_diff']:.3g} logits "
            f"({b['measured']}), so requests at " + (" and ".join(allowed) if allowed else "no named level (a bound "
            f"of at least {b['apart_diff']:.2g} does)") + " share passes; the others keep contexts of their own")
