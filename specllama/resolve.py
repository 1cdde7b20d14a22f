"""Turning a model argument into local GGUF paths."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import ModelNotFoundError


def resolve_model(ref: str) -> Path:
    """A local .gguf path for ref."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(f"model file not found: {path}")


def resolve_pair(target: str, draft: str) -> tuple[Path, Optional[Path], str]:
    """(target path, draft path or None, a one-line note for the user or "")."""
    target_path = resolve_model(target)
    if draft in ("none", ""):
        return target_path, None, ""
    if draft == "auto":
        return target_path, None, "no draft selected automatically; running the target alone (use --draft PATH)"
    return target_path, resolve_model(draft), ""
