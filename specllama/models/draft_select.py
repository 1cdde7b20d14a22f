"""Finding a same-family draft for a target automatically.

1. Fingerprint the target from its GGUF header.
2. Candidates: models.toml pairs, then a Hub search, then GGUFs already on disk (HF cache,
   the target's own folder), which works offline.
3. Rank: same basename and finetune first, then the smallest size ratio, official org, downloads.
4. Check each candidate's vocabulary from its header alone (HTTP range requests for remote
   files, stopping as soon as a mismatch shows); only the winner is downloaded.
5. Cache the decision per target so the next run makes no network call.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import gguf_check
from .. import paths
from .compat import CHECK_START_TOKEN_ID, VocabInfo, check_compatible, early_mismatch, vocab_info_from_gguf
from ..errors import IncompatibleDraftError
from .hub import Hub, HubError
from .registry import Registry
from .resolve import DRAFT_QUANT_PREFERENCE, RepoRef, choose_file, parse_ref

MAX_SIZE_RATIO = 1 / 3  # above this a draft costs too much of a target step to pay off
MAX_CANDIDATES = 12
OFFICIAL_QUANTIZERS = {"bartowski", "unsloth", "lmstudio-community", "ggml-org", "mradermacher", "QuantFactory"}


@dataclass
class Fingerprint:
    architecture: str = ""
    basename: str = ""
    finetune: str = ""
    size_label: str = ""
    organization: str = ""
    base_models: list[str] = field(default_factory=list)
    tokenizer: str = ""
    tokenizer_pre: str = ""
    n_vocab: int = 0
    bos: int = -1
    eos: int = -1
    vocab_hash: str = ""
    n_bytes: int = 0


def fingerprint(fields: dict, n_bytes: int) -> Fingerprint:
    tokens = fields.get("tokenizer.ggml.tokens") or []
    digest = hashlib.sha256("\n".join(tokens[CHECK_START_TOKEN_ID:]).encode("utf-8")).hexdigest()[:16]
    n_base = fields.get("general.base_model.count", 0) or 0
    base = [fields.get(f"general.base_model.{i}.name", "") or fields.get(f"general.base_model.{i}.repo_url", "")
            for i in range(n_base if isinstance(n_base, int) else 0)]
    return Fingerprint(
        architecture=fields.get("general.architecture", ""), basename=fields.get("general.basename", ""),
        finetune=fields.get("general.finetune", ""), size_label=fields.get("general.size_label", ""),
        organization=fields.get("general.organization", ""), base_models=[b for b in base if b],
        tokenizer=fields.get("tokenizer.ggml.model", ""), tokenizer_pre=fields.get("tokenizer.ggml.pre", ""),
        n_vocab=len(tokens), bos=fields.get("tokenizer.ggml.bos_token_id", -1),
        eos=fields.get("tokenizer.ggml.eos_token_id", -1), vocab_hash=digest, n_bytes=n_bytes)


@dataclass
class Candidate:
    source: str  # "models.toml", "hub search", "local"
    repo_id: Optional[str] = None
    filename: Optional[str] = None
    path: Optional[str] = None  # local candidates
    n_bytes: int = 0
    downloads: int = 0
    size_ratio: float = 0.0
    same_family: bool = False
    official: bool = False
    verdict: str = "unchecked"  # "compatible", "rejected", "unchecked"
    reason: str = ""
    header_bytes: int = 0

    @property
    def label(self) -> str:
        if self.path:
            return self.path
        return f"{self.repo_id}/{self.filename}" if self.filename else (self.repo_id or "?")

    def rank_key(self) -> tuple:
        return (not self.same_family, self.size_ratio >= 1, self.size_ratio, not self.official, -self.downloads)


@dataclass
class Decision:
    target: str
    fingerprint: Fingerprint
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Optional[Candidate] = None
    draft_path: Optional[str] = None
    reason: str = ""
    header_bytes: int = 0
    from_cache: bool = False
    warning: str = ""

    def as_dict(self) -> dict:
        out = asdict(self)
        out["candidates"] = [asdict(c) | {"label": c.label} for c in self.candidates]
        return out


_SIZE_RE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([bm])(?![a-z])", re.IGNORECASE)


def _size_in_params(text: str) -> Optional[float]:
    m = _SIZE_RE.search(text.replace("_", "-"))
    if not m:
        return None
    return float(m.group(1)) * (1e9 if m.group(2).lower() == "b" else 1e6)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9.]", "", text.lower())


def _finetune(text: str) -> str:
    return _norm(text.split("-")[0])


def _same_family(fp: Fingerprint, name: str, fields: Optional[dict] = None) -> bool:
    if fields and "general.basename" in fields:
        # "Instruct-GGUF" and "Instruct-AWQ" are one finetune: compare the part before packaging tags
        return (_norm(fields.get("general.basename", "")) == _norm(fp.basename)
                and _finetune(fields.get("general.finetune", "")) == _finetune(fp.finetune))
    n = _norm(name)
    return bool(fp.basename) and _norm(fp.basename) in n and _finetune(fp.finetune) in n


def _target_key(target_path: Path, repo: Optional[str], filename: Optional[str], revision: Optional[str]) -> str:
    if repo:
        return f"hub|{repo}|{filename}|{revision}"
    st = target_path.stat()
    return f"file|{target_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _cached(key: str) -> Optional[dict]:
    return paths.read_cached("drafts.json", key)


def _store(key: str, value: dict) -> None:
    paths.write_cached("drafts.json", key, value)


def local_search_dirs(target_path: Path) -> list[Path]:
    """Folders where people keep GGUFs: the target's own, llama.cpp's and LM Studio's caches."""
    dirs = [target_path.resolve().parent]
    llama_cache = os.environ.get("LLAMA_CACHE") or str(Path.home() / ".cache" / "llama.cpp")
    dirs += [Path(llama_cache), Path.home() / ".lmstudio" / "models"]
    return [d for d in dirs if d.is_dir()]


def select_draft(target_path: Path, hub: Hub, registry: Registry, *, repo_id: Optional[str] = None,
                 filename: Optional[str] = None, revision: Optional[str] = None, use_cache: bool = True,
                 download: bool = True) -> Decision:
    """Find, check and (if download) fetch the best draft for the target at target_path."""
    header = gguf_check.read_header(target_path)
    n_target_bytes = target_path.stat().st_size
    fp = fingerprint(header.fields, n_target_bytes)
    decision = Decision(str(repo_id and f"{repo_id}/{filename}" or target_path), fp)
    key = _target_key(target_path, repo_id, filename, revision)
    if use_cache:
        hit = _cached(key)
        if hit and hit.get("draft_path") and Path(hit["draft_path"]).exists():
            decision.chosen = Candidate(**hit["chosen"])
            decision.draft_path, decision.reason, decision.from_cache = hit["draft_path"], hit["reason"], True
            return decision
    target_vocab = vocab_info_from_gguf(target_path.name, header.fields)

    candidates = _gather(fp, target_path, repo_id, hub, registry)
    for c in candidates:
        c.size_ratio = c.n_bytes / n_target_bytes if c.n_bytes else float("inf")
    candidates.sort(key=Candidate.rank_key)
    decision.candidates = candidates

    for c in candidates:
        if c.verdict == "rejected":
            continue
        if c.size_ratio >= 1:
            c.verdict, c.reason = "rejected", "not smaller than the target"
            continue
        _check(c, target_vocab, hub)
        if c.verdict == "compatible":
            decision.chosen = c
            break
    decision.header_bytes = sum(c.header_bytes for c in candidates)
    if decision.chosen is None:
        decision.reason = ("no compatible draft found" + (f" among {len(candidates)} candidates" if candidates
                                                          else " (no candidates)"))
        return decision
    c = decision.chosen
    decision.reason = f"{c.label}: same vocabulary, {c.size_ratio:.0%} of the target's size ({c.source})"
    if c.size_ratio > MAX_SIZE_RATIO:
        decision.warning = (f"the draft is {c.size_ratio:.0%} of the target's size; above a third it usually "
                            "costs more than it saves")
    if download:
        path = Path(c.path) if c.path else hub.download(_str(c.repo_id), _str(c.filename), sha256=registry.sha256)
        decision.draft_path = str(path)
        _store(key, {"draft_path": str(path), "chosen": asdict(c), "reason": decision.reason})
    return decision


def _gather(fp: Fingerprint, target_path: Path, target_repo: Optional[str], hub: Hub,
            registry: Registry) -> list[Candidate]:
    seen: set[tuple] = set()
    out: list[Candidate] = []

    def add(c: Candidate) -> None:
        k = (c.repo_id, c.filename) if c.repo_id else (c.path,)
        if k not in seen and len(out) < MAX_CANDIDATES:
            seen.add(k)
            out.append(c)

    hub.reachable()  # one quick check, so an unreachable Hub costs seconds, not retries
    # 1. models.toml: by the target's repo id, or by its name when it is a local file
    target_names = [target_repo] if target_repo else []
    stem = _norm(f"{fp.basename}-{fp.size_label}-{fp.finetune}")
    for pair in registry.pairs:
        if any(t.lower() == (target_repo or "").lower() or (stem and _norm(t.split("/")[-1]).startswith(stem))
               for t in pair.targets):
            ref = parse_ref(pair.draft, registry)
            if isinstance(ref, RepoRef):
                add(_remote(ref.repo_id, ref.selector, "models.toml", fp, hub))
    # 2. the Hub: same basename, GGUF, most downloaded first
    if fp.basename:
        for info in hub.search(search=fp.basename, filter="gguf", sort="downloads", limit=30):
            name = info.id.split("/")[-1]
            size = _size_in_params(name)
            target_size = _size_in_params(fp.size_label or "")
            if info.id in target_names or (size and target_size and size >= target_size):
                continue
            if not _same_family(fp, name) and _norm(fp.basename) not in _norm(name):
                continue
            c = _remote(info.id, None, "hub search", fp, hub, downloads=getattr(info, "downloads", 0) or 0)
            add(c)
    # 3. on disk: the HF cache and the usual model folders
    target_resolved = target_path.resolve()
    local: list[Path] = [p for _, _, p in hub.cached_ggufs()]
    for d in local_search_dirs(target_path):
        local += sorted(d.rglob("*.gguf")) if d != target_resolved.parent else sorted(d.glob("*.gguf"))
    for p in local:
        if p.resolve() == target_resolved or not p.is_file():
            continue
        add(Candidate("local", path=str(p), n_bytes=p.stat().st_size,
                      same_family=_same_family(fp, p.name, _leading_fields(p))))
    return out


def _remote(repo_id: str, selector: Optional[str], source: str, fp: Fingerprint, hub: Hub,
            downloads: int = 0) -> Candidate:
    c = Candidate(source, repo_id=repo_id, downloads=downloads, same_family=_same_family(fp, repo_id),
                  official=bool(fp.organization) and repo_id.split("/")[0].lower() == _norm(fp.organization)
                  or repo_id.split("/")[0] in OFFICIAL_QUANTIZERS)
    try:
        _, files = hub.gguf_files(repo_id)
        try:
            c.filename, _ = choose_file(repo_id, files, selector, DRAFT_QUANT_PREFERENCE)
        except HubError:  # a models.toml quant is a preference: take the best one there is
            c.filename, _ = choose_file(repo_id, files, None, DRAFT_QUANT_PREFERENCE)
        c.n_bytes = files.get(c.filename, 0)
    except HubError as e:
        c.verdict, c.reason = "rejected", str(e)
    return c


def _check(c: Candidate, target: VocabInfo, hub: Hub) -> None:
    if c.verdict == "rejected":
        return
    try:
        if c.path:
            fields = gguf_check.read_header(c.path).fields
        else:
            read = hub.read_header(_str(c.repo_id), _str(c.filename),
                                   reject=lambda partial, lengths: early_mismatch(target, partial, lengths))
            c.header_bytes = read.n_bytes_fetched
            fields, complete = read.fields, read.complete
            if not complete:
                c.verdict = "rejected"
                c.reason = early_mismatch(target, read.fields, read.array_lengths) or "incomplete header"
                return
    except (HubError, gguf_check.InvalidModelFileError) as e:
        c.verdict, c.reason = "rejected", str(e)
        return
    try:
        check_compatible(target, vocab_info_from_gguf(c.label, fields))
    except IncompatibleDraftError as e:
        c.verdict, c.reason = "rejected", str(e).split(": ", 1)[-1].split("; pick")[0]
        return
    c.verdict, c.reason = "compatible", "same vocabulary"


def _str(value: Optional[str]) -> str:
    """A Hub candidate's repo id or file name (local candidates have a path instead)."""
    assert value is not None
    return value


def _leading_fields(path: Path) -> Optional[dict]:
    """The general.* metadata at the start of a local GGUF, without parsing its vocabulary."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
        return gguf_check.parse(head, path.stat().st_size).fields
    except gguf_check.NeedMoreBytes as e:
        return e.partial
    except (OSError, ValueError):
        return None


MTP = "mtp"  # the draft that is the target's own MTP layers


def n_mtp_layers(path: Path) -> int:
    """MTP (nextn) layers a GGUF declares ({arch}.nextn_predict_layers)."""
    fields = gguf_check.read_header(path).fields
    return int(fields.get(f"{fields.get('general.architecture', '')}.nextn_predict_layers", 0) or 0)


def resolve_pair(target: str, draft: Optional[str], *, hub: Optional[Hub] = None,
                 registry: Optional[Registry] = None) -> tuple[Path, Any, list[str]]:
    """Local paths for a target reference and a draft reference ("auto", "mtp", "none", or a ref).

    Returns (target path, draft, notes): draft is the draft's path, MTP (the target's own MTP
    layers) or None; notes are lines worth telling the user. "auto" prefers the target's MTP
    layers where its GGUF has them.
    """
    from . import registry as registry_module
    from .resolve import resolve

    hub = hub or Hub.from_env()
    registry = registry or registry_module.load()
    notes: list[str] = []
    t = resolve(str(target), hub, registry)
    if t.note:
        notes.append(t.note)
    if draft is None or draft in ("", "none"):
        return t.path, None, notes
    if draft == "mtp":
        return t.path, MTP, notes
    n_mtp = n_mtp_layers(t.path) if draft == "auto" else 0
    if n_mtp:
        notes.append(f"draft: the MTP heads in {t.path.name} ({n_mtp} nextn layer(s)): "
                     "no second model to load, and trained on the target's own hidden states")
        return t.path, MTP, notes
    if draft != "auto":
        d = resolve(str(draft), hub, registry)
        return t.path, d.path, notes + ([d.note] if d.note else [])
    decision = select_draft(t.path, hub, registry, repo_id=t.repo_id, filename=t.filename, revision=t.revision)
    if decision.draft_path is None:
        notes.append(f"draft: {decision.reason}; running the target alone")
        return t.path, None, notes
    why = "cached choice" if decision.from_cache else decision.reason
    notes.append(f"draft: {Path(decision.draft_path).name} ({why})")
    if decision.warning:
        notes.append(f"draft: {decision.warning}")
    return t.path, Path(decision.draft_path), notes
