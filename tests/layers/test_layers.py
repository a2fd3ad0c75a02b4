"""Finding and splitting layers: one file per kind, registered; fused projections split by head counts."""

import re

import pytest
from conftest import tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers.targets import select_targets

VOCAB = 500


def test_fused_parts_are_named_and_split():
    engine = SpectralEngine(tiny_model("phi3", vocab=VOCAB), "all")
    names = engine.part_names
    assert "model.layers.1.self_attn.qkv_proj.k" in names and "model.layers.0.mlp.gate_up_proj.up" in names
    sizes = {p.name: p.d_out for p in engine.parts}
    assert sizes["model.layers.0.self_attn.qkv_proj.q"] == 64 and sizes["model.layers.0.self_attn.qkv_proj.v"] == 32


def test_no_matching_modules_lists_what_exists():
    message = ("no module matches modules '*.nothing_here'; pass a preset (attn, mlp, experts, router, all, lora), "
               "a role of this model (q, k, v, o, gate, up, down) or a glob of its part names (e.g. "
               "'model.layers.0.self_attn.q_proj'; 14 in all)")
    with pytest.raises(ValueError, match=re.escape(message)):
        SpectralEngine(tiny_model("llama", vocab=VOCAB), "*.nothing_here")


def test_module_patterns_select_by_glob_and_role():
    model = tiny_model("llama", vocab=VOCAB)
    assert SpectralEngine(model, "*.1.*v_proj").part_names == ["model.layers.1.self_attn.v_proj"]
    assert len(SpectralEngine(model, "down,q").part_names) == 4


def test_every_module_pattern_must_match_something():
    """A typo among good patterns is not dropped silently; a preset counts as matched by any of its roles."""
    model = tiny_model("gpt2")
    assert select_targets(model, "mlp")  # GPT-2 has up and down, no gate
    with pytest.raises(ValueError, match=r"no module matches 'zz', '\*\.7\.\*' of modules; pass a preset"):
        select_targets(model, "q,zz,*.7.*")
