"""`gradspec report` of a spectral monitor's output: spectra over a run as pictures, their numbers
those of the rows."""

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from gradspec.analysis.monitor_report import moved_samples, part_role, read_drawn, write_monitor_report
from gradspec.cli import main
from gradspec.training.monitor import SpectralMonitor
from gradspec.training.sample_index import with_sample_index
from gradspec.training.wit import WITCollator

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
]


@pytest.fixture(scope="module")
def monitored(tokenizer, tmp_path_factory):
    """Three monitored steps of a loop that learns: every row at every step, in two micro-batches."""
    torch.manual_seed(0)
    model = tiny_model("llama").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = tmp_path_factory.mktemp("monitor") / "monitor.parquet"
    monitor = SpectralMonitor(every=1, modules="all", out=out)
    collate, rows = WITCollator(tokenizer), with_sample_index(ROWS)
    for step in (1, 2, 3):
        with monitor.step(model, step=step, accumulation=2):
            for half in (rows[:2], rows[2:]):
                (model(**collate(half)).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:  # a run not yet closed: its parts so far
            unclosed = tmp_path_factory.mktemp("unclosed")
            write_monitor_report(out, unclosed / "report")
    monitor.close()
    return out, unclosed


def test_the_pictures_hold_the_rows_means(monitored, tmp_path):
    monitored, unclosed = monitored
    assert "8 rows with spectra over 2 monitored steps (1 to 2)" in (unclosed / "report" / "report.md").read_text()
    report = write_monitor_report(monitored, tmp_path / "report")
    assert sorted(p.name for p in report.iterdir()) == [
        "heatmap_effective_rank.png", "heatmap_nuclear_norm.png", "moved.png", "report.md", "roles_effective_rank.png",
        "roles_nuclear_norm.png"]
    rows, parts = read_drawn(monitored)
    every = pd.read_parquet(monitored)
    assert len(rows) == 12 and set(parts["role"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert not any(c.endswith(("/spectral_norm", "/stable_rank")) for c in rows.columns)  # only what is drawn
    from gradspec.analysis.monitor_report import _by_layer

    grid = _by_layer(rows, parts, "nuclear_norm", "q")
    name = parts[(parts["role"] == "q") & (parts["layer"] == 1)]["name"].item()
    assert grid.loc[1, 2] == pytest.approx(every.loc[every["step"] == 2, f"{name}/nuclear_norm"].mean(), rel=1e-12)
    moved = moved_samples(rows, parts)
    assert sorted(moved["sample_index"]) == [0, 1, 2, 3] and (moved[["first_step", "last_step"]] == [1, 3]).all().all()
    mean = every[[f"{n}/effective_rank" for n in parts["name"]]].mean(axis=1)
    first, last = (mean[(every["sample_index"] == 2) & (every["step"] == s)].item() for s in (1, 3))
    assert moved.set_index("sample_index").loc[2, "change"] == pytest.approx(last - first, rel=1e-12)
    assert moved["change"].abs().is_monotonic_decreasing
    text = (report / "report.md").read_text()
    assert "12 rows with spectra over 3 monitored steps (1 to 3)" in text and "sample_index |" in text


def test_gradspec_report_draws_a_monitor_file_or_folder(monitored, tmp_path, capsys):
    monitored, _ = monitored
    assert main(["report", str(monitored), "--out", str(tmp_path / "file")]) == 0
    assert (tmp_path / "file" / "heatmap_effective_rank.png").is_file()
    assert main(["report", str(monitored.parent), "--out", str(tmp_path / "folder")]) == 0
    assert (tmp_path / "folder" / "report.md").read_text().count("12 rows with spectra") == 1
    assert main(["report", str(tmp_path / "folder" / "report.md")]) == 2
    assert "expected LABEL=SCORES" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "role"), [
    ("model.layers.3.self_attn.q_proj", "q"), ("model.layers.0.self_attn.qkv_proj.k", "k"),
    ("model.layers.1.mlp.experts.7.gate_proj", "expert_gate"), ("model.layers.1.mlp.gate", "router"),
    ("transformer.h.0.attn.c_attn.v", "v"), ("model.layers.2.mlp.down_proj", "down"), ("lm_head", "other")])
def test_a_part_s_role_from_its_name(name, role):
    assert part_role(name, {}) == role
    assert part_role(name, {name: "recorded"}) == "recorded"


@pytest.mark.parametrize("indexed", [True, False], ids=["each sample once", "no sample_index"])
def test_the_report_says_why_no_sample_s_course_is_drawn_and_what_a_step_holds(monitored, tmp_path, indexed):
    """One epoch monitored every few steps sees each sample once: the report said 'give the rows their index'
    while every row had one; and its per-step pictures compare batches of other samples, which it now says."""
    monitored, _ = monitored
    rows = pd.read_parquet(monitored)
    rows["sample_index"] = range(len(rows)) if indexed else None
    once = tmp_path / "once.parquet"
    rows.to_parquet(once)
    text = (write_monitor_report(once, tmp_path / "report") / "report.md").read_text()
    if indexed:
        assert "Each of the 12 samples was monitored at one step only" in text and "give the rows" not in text
        assert "2 of 2 pairs of consecutive monitored steps share no sample" in text
    else:
        assert "No row has a sample_index" in text and "cannot say whether two steps saw the same samples" in text
