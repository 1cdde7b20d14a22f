"""Where specllama keeps its files: SPECLLAMA_HOME if set, else the platform's user dirs."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def home() -> Path | None:
    value = os.environ.get("SPECLLAMA_HOME")
    return Path(value).expanduser() if value else None


def config_dir() -> Path:
    if home() is not None:
        return home()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "specllama"
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "specllama"


def cache_dir() -> Path:
    if home() is not None:
        return home() / "cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "specllama"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specllama"
