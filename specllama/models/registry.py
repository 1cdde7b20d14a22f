"""models.toml: aliases and known-good target -> draft pairs, shipped and user-extended."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from .. import paths
from ..errors import SpecLlamaError


class RegistryError(SpecLlamaError):
    """A models.toml file is malformed; the message names the file, the table and the key."""


@dataclass(frozen=True)
class Pair:
    family: str
    targets: tuple[str, ...]
    draft: str
    verified: bool = False
    note: str = ""
    source: str = ""


@dataclass
class Registry:
    aliases: dict[str, str] = field(default_factory=dict)
    pairs: list[Pair] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)  # "owner/repo/file.gguf" -> hex digest

    def resolve_alias(self, name: str) -> Optional[str]:
        return self.aliases.get(name) or self.aliases.get(name.lower())

    def drafts_for(self, repo_id: str) -> list[Pair]:
        """Pairs listing repo_id as a target (case-insensitive), user pairs first."""
        return [p for p in self.pairs if repo_id.lower() in (t.lower() for t in p.targets)]


_PAIR_KEYS: dict[str, tuple[type, bool]] = {  # key: (type, required)
    "family": (str, True), "targets": (list, True), "draft": (str, True),
    "verified": (bool, False), "note": (str, False),
}
_TOP_KEYS = {"aliases", "pairs", "sha256"}
_HEX = set("0123456789abcdef")


def parse(text: str, source: str) -> Registry:
    """Validate one models.toml's text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{source}: not valid TOML: {e}") from None
    for key in data:
        if key not in _TOP_KEYS:
            raise RegistryError(f"{source}: unknown top-level key {key!r} (allowed: aliases, [[pairs]], sha256)")
    aliases = data.get("aliases", {})
    if not isinstance(aliases, dict):
        raise RegistryError(f"{source}: [aliases] must be a table of name = \"repo:quant\" strings")
    for name, ref in aliases.items():
        if not isinstance(ref, str) or not ref:
            raise RegistryError(f"{source}: [aliases] key {name!r} must be a non-empty string, not {ref!r}")
    sha256 = data.get("sha256", {})
    if not isinstance(sha256, dict):
        raise RegistryError(f'{source}: [sha256] must be a table of "owner/repo/file.gguf" = "hex digest"')
    for name, digest in sha256.items():
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest.lower()) <= _HEX:
            raise RegistryError(f"{source}: [sha256] key {name!r} must be a 64-digit hex SHA-256, not {digest!r}")
    pairs_data = data.get("pairs", [])
    if not isinstance(pairs_data, list):
        raise RegistryError(f"{source}: 'pairs' must be an array of tables ([[pairs]])")
    pairs = []
    for i, entry in enumerate(pairs_data, 1):
        where = f"{source}: [[pairs]] #{i}"
        if not isinstance(entry, dict):
            raise RegistryError(f"{where} must be a table")
        for key in entry:
            if key not in _PAIR_KEYS:
                raise RegistryError(f"{where}: unknown key {key!r} (allowed: {', '.join(_PAIR_KEYS)})")
        for key, (kind, required) in _PAIR_KEYS.items():
            if key not in entry:
                if required:
                    raise RegistryError(f"{where}: missing key {key!r}")
                continue
            value = entry[key]
            if not isinstance(value, kind) or (isinstance(value, list) and not all(isinstance(t, str) and t
                                                                                   for t in value)):
                want = "a list of repo ids" if kind is list else kind.__name__
                raise RegistryError(f"{where}: key {key!r} must be {want}, not {value!r}")
        pairs.append(Pair(entry["family"], tuple(entry["targets"]), entry["draft"],
                          entry.get("verified", False), entry.get("note", ""), source))
    return Registry(dict(aliases), pairs, [source], {k: v.lower() for k, v in sha256.items()})


def user_file() -> Path:
    return paths.config_dir() / "models.toml"


def load() -> Registry:
    """The shipped models.toml extended by the user's (its aliases win, its pairs go first)."""
    shipped = resources.files("specllama").joinpath("models.toml")
    registry = parse(shipped.read_text(encoding="utf-8"), "specllama/models.toml")
    path = user_file()
    if path.exists():
        user = parse(path.read_text(encoding="utf-8"), str(path))
        registry = Registry({**registry.aliases, **user.aliases}, user.pairs + registry.pairs,
                            user.sources + registry.sources, {**registry.sha256, **user.sha256})
    return registry


def as_dict(registry: Registry) -> dict[str, Any]:
    return {"aliases": registry.aliases, "pairs": [vars(p) | {"targets": list(p.targets)} for p in registry.pairs],
            "sources": registry.sources}
