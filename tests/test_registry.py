"""models.toml: the shipped file validates; broken user files say where they are broken."""

from __future__ import annotations

import pytest

from specllama.models import registry
from specllama.models.registry import RegistryError


def test_shipped_file_validates():
    reg = registry.load()
    assert reg.resolve_alias("qwen2.5-coder-7b") == "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m"
    pairs = reg.drafts_for("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF")
    assert pairs and pairs[0].verified and pairs[0].draft.startswith("Qwen/Qwen2.5-Coder-0.5B")
    families = {p.family for p in reg.pairs}
    assert {"Qwen2.5-Coder", "Qwen3", "Llama 3.x", "Gemma 3", "Mistral", "Phi", "DeepSeek-R1-Distill-Qwen"} <= families


def test_user_file_extends_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path))
    (tmp_path / "models.toml").write_text(
        '[aliases]\n"qwen2.5-coder-7b" = "me/mine-GGUF:q8_0"\n"mine" = "me/other-GGUF"\n'
        '[[pairs]]\nfamily = "Mine"\ntargets = ["Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"]\ndraft = "me/tiny-GGUF"\n')
    reg = registry.load()
    assert reg.resolve_alias("qwen2.5-coder-7b") == "me/mine-GGUF:q8_0"
    assert reg.resolve_alias("mine") == "me/other-GGUF"
    assert reg.resolve_alias("qwen3-8b") is not None  # shipped aliases remain
    assert reg.drafts_for("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF")[0].draft == "me/tiny-GGUF"


@pytest.mark.parametrize("text, message", [
    ('[[pairs]]\nfamily = "x"\ntargets = ["a/b"]\ndraft = "c/d"\nspeed = 3\n',
     r"\[\[pairs\]\] #1: unknown key 'speed'"),
    ('[[pairs]]\nfamily = "x"\ntargets = "a/b"\ndraft = "c/d"\n', r"\[\[pairs\]\] #1: key 'targets' must be a list"),
    ('[[pairs]]\nfamily = "x"\ntargets = ["a/b"]\n', r"\[\[pairs\]\] #1: missing key 'draft'"),
    ('[[pairs]]\nfamily = "x"\ntargets = ["a/b"]\ndraft = "c/d"\nverified = "yes"\n', "key 'verified' must be bool"),
    ('[aliases]\nfoo = 3\n', r"\[aliases\] key 'foo' must be a non-empty string"),
    ('[models]\n', "unknown top-level key 'models'"),
    ('[[pairs]\n', "not valid TOML"),
])
def test_broken_user_file_names_file_table_and_key(tmp_path, monkeypatch, text, message):
    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path))
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(RegistryError, match=message) as info:
        registry.load()
    assert str(path) in str(info.value)
