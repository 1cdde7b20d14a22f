"""Surfaces: the shapes other tools speak, translated onto the one generate path.
llama_api.py gives a SpecLlama llama-cpp-python's create_completion and create_chat_completion;
completions.py builds their dicts and chunks; messages.py renders chat messages through the
model's template; tools.py turns tool definitions into grammars and parses tool calls; fim.py
builds fill-in-the-middle prompts from a GGUF's FIM tokens. The HTTP server's translators live
in server/."""
