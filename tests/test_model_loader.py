"""Model resolution: the GGUF conversion cache is atomic and keyed by the file."""

from __future__ import annotations

import pytest

from engine.model import loader as model_loader
from engine.model.loader import ModelLoadError, resolve_model_dir


def test_default_model_resolves_to_a_transformers_directory(model_dir):
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "tokenizer.json").is_file()
    assert resolve_model_dir(model_dir) == model_dir


def test_killed_conversion_leaves_nothing_a_later_run_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really gguf")
    calls = []

    def dies_half_way(src, out_dir):
        (out_dir / "config.json").write_text("{}")  # half-written: config but no weights
        calls.append(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(model_loader, "_convert_gguf", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(gguf)
    models = tmp_path / "models"
    assert list(models.iterdir()) == []  # the temporary directory is gone, no target exists

    def completes(src, out_dir):
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"w")
        calls.append(out_dir)

    monkeypatch.setattr(model_loader, "_convert_gguf", completes)
    target = resolve_model_dir(gguf)
    assert (target / "model.safetensors").is_file() and target.parent == models
    assert resolve_model_dir(gguf) == target and len(calls) == 2  # converted once, then cached


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_dir(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir(tmp_path)
