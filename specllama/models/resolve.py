"""Model references: a local .gguf path, a Hub repo id (optionally :quant or :file.gguf), or
an alias from models.toml. One resolver serves the API and the CLI."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ModelNotFoundError
from .hub import SPLIT_RE, Hub, HubError
from .registry import Registry

REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# preferred quantizations when a repo holds several and none was named
QUANT_PREFERENCE = ["q4_k_m", "q4_k_l", "q4_k_s", "q5_k_m", "q4_0", "iq4_xs", "q5_k_s", "q6_k", "q8_0",
                    "q3_k_l", "q3_k_m", "q5_0", "q4_1", "q2_k", "f16", "bf16", "f32"]
DRAFT_QUANT_PREFERENCE = ["q8_0", "q4_k_m"] + [q for q in QUANT_PREFERENCE if q not in ("q8_0", "q4_k_m")]
QUANT_RE = re.compile(r"(?<![a-z0-9])(i?q\d(?:_[a-z0-9]+)*|f16|bf16|f32)(?![a-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    selector: Optional[str] = None  # a quant ("q4_k_m") or a file name


@dataclass(frozen=True)
class Resolved:
    """A model on local disk and where it came from."""

    path: Path
    repo_id: Optional[str] = None
    filename: Optional[str] = None
    revision: Optional[str] = None
    note: str = ""


def parse_ref(ref: str, registry: Registry) -> Path | RepoRef:
    """Classify a model argument. Aliases are expanded."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    alias = registry.resolve_alias(ref)
    if alias is not None:
        return parse_ref(alias, registry)
    repo, _, selector = ref.partition(":")
    if REPO_RE.match(repo) and not ref.startswith(("/", ".", "~")):
        return RepoRef(repo, selector or None)
    if ref.lower().endswith(".gguf") or "/" in ref or ref.startswith("."):
        raise ModelNotFoundError(f"model file not found: {path}")
    raise ModelNotFoundError(f"{ref!r} is not a file, a models.toml alias or a Hub repo id (owner/name[:quant]); "
                             "`specllama models` lists the aliases")


def quant_of(filename: str) -> Optional[str]:
    name = SPLIT_RE.sub(".gguf", Path(filename).name)
    found = QUANT_RE.findall(name[:-5].replace("-", "_") if name.lower().endswith(".gguf") else name)
    return found[-1].lower() if found else None


def _first_part(filename: str) -> bool:
    """Whether a GGUF file is loadable by name: whole, or the first part of a split one."""
    split = SPLIT_RE.search(filename)
    return split is None or split.group(1) == "00001"


def choose_file(repo_id: str, files: dict[str, int], selector: Optional[str],
                preference: list[str] = QUANT_PREFERENCE) -> tuple[str, str]:
    """Pick one GGUF (the first part of a split one) from a repo. Returns (filename, note)."""
    loadable = {f: s for f, s in files.items() if _first_part(f)}
    loadable = {f: s for f, s in loadable.items() if "mmproj" not in f.lower()}
    if not loadable:
        raise HubError(f"{repo_id} has no .gguf files")
    if selector and selector.lower().endswith(".gguf"):
        for f in loadable:
            if f.lower() == selector.lower() or Path(f).name.lower() == selector.lower():
                return f, ""
        raise HubError(f"{repo_id} has no file {selector!r}; it has: {', '.join(sorted(loadable))}")
    by_quant: dict[str, str] = {}
    for f in sorted(loadable):
        by_quant.setdefault(quant_of(f) or "", f)
    if selector:
        wanted = selector.lower().replace("-", "_")
        if wanted in by_quant:
            return by_quant[wanted], ""
        raise HubError(f"{repo_id} has no {selector.upper()} file; quants there: "
                       f"{', '.join(q.upper() for q in sorted(by_quant) if q)}")
    for quant in preference:
        if quant in by_quant:
            name = by_quant[quant]
            note = "" if len(loadable) == 1 else (f"{repo_id}: using {Path(name).name} ({quant.upper()}) of "
                                                 f"{len(loadable)} files; add :QUANT to pick another")
            return name, note
    name = sorted(loadable)[0]
    return name, f"{repo_id}: using {name}"


def resolve(ref: str, hub: Hub, registry: Registry) -> Resolved:
    """Local path of the model ref names, downloading it through huggingface_hub if needed."""
    parsed = parse_ref(ref, registry)
    if isinstance(parsed, Path):
        return Resolved(parsed)
    revision, files = hub.gguf_files(parsed.repo_id)
    filename, note = choose_file(parsed.repo_id, files, parsed.selector)
    path = hub.download(parsed.repo_id, filename, revision=revision or None, sha256=registry.sha256)
    return Resolved(path, parsed.repo_id, filename, revision or None, note)
