"""Where specllama keeps its files: SPECLLAMA_HOME if set, else the platform's user dirs."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Optional


def home() -> Path | None:
    value = os.environ.get("SPECLLAMA_HOME")
    return Path(value).expanduser() if value else None


def config_dir() -> Path:
    user = home()
    if user is not None:
        return user
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "specllama"
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "specllama"


def cache_dir() -> Path:
    user = home()
    if user is not None:
        return user / "cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "specllama"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specllama"


def read_cached(name: str, key: str) -> Optional[Any]:
    """The entry `key` of the JSON file `name` in the cache dir, or None."""
    try:
        return json.loads((cache_dir() / name).read_text()).get(key)
    except (OSError, ValueError):
        return None


_WRITING = threading.Lock()  # requests finishing side by side write the same file


def write_cached(name: str, key: str, value: Any) -> None:
    """Set entry `key` of the JSON file `name` in the cache dir (atomic replace)."""
    path = cache_dir() / name
    with _WRITING:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
