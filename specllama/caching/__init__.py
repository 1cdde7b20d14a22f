"""Caching: reusing what a model already computed for a prompt. prompt_cache.py decides which
saved, live or on-disk state to reuse and how much, within the RAM budget; disk_cache.py keeps
saved states in a folder on disk (checked headers, atomic renames, a disk budget, a writer
thread)."""
