"""Docs and examples that say what the code does (issue 40's stale lines)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_no_developer_paths_in_the_readme():
    # old code: the Slurm dry-run showed "/work/wt/i17/.venv/bin/python"
    assert not re.search(r"/work/wt/|/root/", (ROOT / "README.md").read_text())


def test_example_comments_give_the_ranks_they_run_on():
    # old code: examples/space.yaml said "(4 ranks)" above world_size: 2
    text = (ROOT / "examples" / "space.yaml").read_text()
    header = " ".join(line for line in text.splitlines() if line.startswith("#"))
    said = re.search(r"(\d+) ranks", header)
    assert said and int(said.group(1)) == yaml.safe_load(text)["world_size"]


def test_gpu_page_status_agrees_with_its_measured_section():
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert "## Measured on a GPU" in text
    assert "not measured on a GPU" not in text.split("\n## ")[0]  # old code: "Status: not measured on a GPU"


def test_reliability_page_says_the_trainer_uses_model_entry():
    assert "not yet used by the trainer" not in (ROOT / "docs" / "reliability.md").read_text()


def test_the_moe_example_runs_at_a_capacity_that_drops_almost_nothing():
    # old code: capacity_factor 1.25, which dropped 20.6% of the tokens (mean over 20 steps, 2 ranks)
    text = (ROOT / "examples" / "moe.yaml").read_text()
    assert yaml.safe_load(text)["model"]["capacity_factor"] >= 2.0 and "drop_rate" in text


def test_the_docs_list_the_model_types_the_code_takes():
    """Lists the code can check (issue 52 item 9: the model_type list omitted qwen2_moe and qwen3_moe)."""
    from engine.model.shapes import HF_FAMILIES
    from engine.config.validate import HF_TRAINABLE

    text = (ROOT / "docs" / "config.md").read_text()
    trained = re.search(r"`model\.hf` / `hf_weights` \| [^|]*\| a Hugging Face causal LM \(([^)]*)\)", text)
    assert trained and [t.strip() for t in trained.group(1).split(",")] == list(HF_TRAINABLE)
    priced = re.search(r"Hugging Face config\.json of model_type ([a-z0-9_, ]+)", (ROOT / "docs" / "cli.md").read_text())
    assert priced and [t.strip() for t in priced.group(1).split(",")] == list(HF_FAMILIES)


def test_the_docs_state_no_count_of_published_rows_the_code_does_not_have():
    """Old README: "76 published measurements", while simulate --validate printed 23 + 253 rows."""
    from tuning.sim.published import calibration_rows, held_out_rows

    rows = len(calibration_rows()) + len(held_out_rows())
    for page in (ROOT / "README.md", ROOT / "docs" / "cli.md", ROOT / "docs" / "config.md", ROOT / "docs" / "simulator.md",
                 ROOT / "docs" / "simulator-reference.md"):
        for count in re.findall(r"(\d[\d,]*) published (?:measurements|rows)", page.read_text()):
            assert int(count.replace(",", "")) == rows, page
