"""Models: finding, checking and sizing GGUF files before anything is loaded. resolve.py turns
a reference (a path, a Hub repo id, an alias) into a file; hub.py downloads from Hugging Face;
registry.py reads models.toml's aliases and known pairs; draft_select.py picks a same-family
draft; compat.py checks a draft against its target with llama.cpp's rules; gguf_check.py reads
and validates GGUF headers; plan.py plans memory from them. None of these loads llama.cpp."""
