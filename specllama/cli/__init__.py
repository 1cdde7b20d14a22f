"""The specllama command line: click commands in modules by concern, every model and generation
option declared once (options.py). Library errors become one line with the next step."""

from . import bench, cache, inspect, run, serve  # noqa: F401  (each registers its commands)
from .app import main

__all__ = ["main"]
