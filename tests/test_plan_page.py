"""The Plan page (workbench/app_pages/plan.py) under Streamlit's AppTest and in a real headless Chromium: the same
ranked layouts and exports as `workbench plan` for the same inputs, the published layout of a job like it
(tuning/plan_published.py), the dry run of the top layouts with its progress, bad inputs said in one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard_server import start_dashboard

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LLAMA31_8B = REPO / "examples" / "llama3_8b" / "config.json"
# a Llama-shaped model that ranks in seconds (tests/test_plan.py's): its top layouts on 4 GPUs are DDP
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512, "tie_word_embeddings": False,
              "max_position_embeddings": 256}
TINY = {"gpus": 4, "seq": 64, "global_batch": 8, "target": "yaml"}
# `workbench plan --json`'s layout fields and the page's column for each (a human name with its unit)
SHOWN_AS = {"tp": "TP", "pp": "PP", "dp": "DP", "cp": "CP", "cp_impl": "CP kind", "ep": "EP",
            "virtual": "virtual stages", "micro": "micro-batch (sequences)", "zero": "ZeRO stage",
            "recompute": "recompute", "sequence_parallel": "sequence parallel", "schedule": "schedule",
            "iteration_time_s": "iteration (s)", "time_lo_s": "measured likely from (s)",
            "time_hi_s": "measured likely to (s)", "tokens_per_s": "tokens/s", "mfu": "MFU (%)",
            "memory_per_gpu_gb": "memory per GPU (GB)", "framework": "priced as", "attention": "attention kernel",
            "tp_comm_overlap": "TP comm overlap", "precision": "precision"}
CHROMIUM = shutil.which("chromium")

pytestmark = pytest.mark.xdist_group("dashboard")


def _page(home: Path, monkeypatch: pytest.MonkeyPatch, rank: bool = True, **inputs):
    """The Plan page with its inputs set (config.json path, GPUs, seq, ...) and Rank layouts pressed."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_HOME", str(home))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=240)
    at.switch_page("workbench/app_pages/plan.py")
    at.run()
    assert [t.value for t in at.title] == ["Plan"] and not at.exception
    keys = {"path": "plan_model_path", "gpus": "plan_gpus", "seq": "plan_seq", "global_batch": "plan_global",
            "top": "plan_top"}
    for name, value in inputs.items():
        if name == "target":
            at.selectbox(key="plan_target").set_value(value)
        elif name == "upload":
            at.radio(key="plan_model_kind").set_value("an uploaded config.json")
            at.run()
            at.file_uploader(key="plan_upload").set_value(("config.json", value, "application/json"))
            at.run()  # the other inputs are drawn once a model is given
        elif name == "overrides":
            at.text_area(key="plan_set").set_value(value)
        else:
            (at.text_input if name == "path" else at.number_input)(key=keys[name]).set_value(value)
    at.run()
    if rank:
        at.button(key="plan_rank").click()
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _workbench(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "WORKBENCH_HOME": str(cwd / "home"),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(BIN / "workbench"), *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # a second process (the CLI; a dry run)
def test_the_page_ranks_and_exports_what_workbench_plan_does(tmp_path, monkeypatch):
    """Same inputs, same layouts (every field of `plan --json`, under its human name), and each format's download
    is the file `plan --export all -o` writes; torchtitan refuses the tiny shape with the CLI's own line."""
    from streamlit.delta_generator import DeltaGenerator

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    cli = _workbench("plan", "--model", str(tmp_path / "config.json"), "--gpus", "4", "--seq", "64",
                     "--global-batch", "8", "--target", "yaml", "--set", "data.source=synthetic", "--json",
                     "--export", "all", "-o", "out", cwd=tmp_path)  # runs while the page ranks
    downloads: dict[str, str] = {}
    real = DeltaGenerator.download_button

    def recorded(self, label, data, *args, **kwargs):
        downloads[kwargs["file_name"]] = data
        return real(self, label, data, *args, **kwargs)

    monkeypatch.setattr(DeltaGenerator, "download_button", recorded)  # a column's button records its file
    at = _page(tmp_path / "home", monkeypatch, path=str(tmp_path / "config.json"), overrides="data.source=synthetic",
               **TINY)
    stdout, stderr = cli.communicate(timeout=300)
    assert cli.returncode in (0, 2), stderr[-3000:]  # 2 where the CLI counts torchtitan's refusal as a failure
    layouts = json.JSONDecoder().raw_decode(stdout)[0]["layouts"]
    shown = at.dataframe[0].value
    assert list(shown["pick"]) == list(range(1, len(layouts) + 1)) and len(layouts) == 5
    named = {field: SHOWN_AS.get(field, field.replace("_", " ")) for field in layouts[0]}
    assert set(shown.columns) == {"pick", *named.values()}
    assert {"iteration (s)", "measured likely from (s)", "measured likely to (s)", "memory per GPU (GB)"} <= set(named.values())
    for i, row in enumerate(layouts):
        for field, value in row.items():
            cell = shown[named[field]].iloc[i]
            expected = 100.0 * value if field == "mfu" else value
            assert cell == (pytest.approx(expected, rel=1e-9) if isinstance(value, float) else expected), field
    written = {"config.yaml", "megatron.sh", "deepspeed.json", "accelerate.yaml"}
    assert set(downloads) == written
    for name in written:
        # the same bytes, the CLI's comments naming the workbench's defaults included (old page: without them)
        assert downloads[name] == (tmp_path / "out" / name).read_text(), name
    defaults = [line for line in stderr.splitlines() if "the workbench's default, not yours" in line]
    assert defaults and set(defaults) <= set(at.expander[-1].markdown[0].value.replace("- ", "").splitlines())
    refusal = next(line for line in stderr.splitlines() if line.startswith("torchtitan: "))
    assert refusal in [c.value for c in at.caption]
    assert at.button(key="plan_export_torchtitan").disabled
    assert any(i.value.startswith("No published run of a model of 722K parameters") for i in at.info)


def test_the_page_shows_the_published_layout_of_a_job_like_it(tmp_path, monkeypatch):
    """Its defaults (Llama 3.1 8B at 8,192 tokens on 64 H100s for Megatron): NVIDIA's DGX Cloud recipe ran that
    job as dp32 cp2 ZeRO-1 at 10,021 tokens/s per GPU, and the page shows it beside the ranked layouts."""
    at = _page(tmp_path, monkeypatch)
    assert at.text_input(key="plan_model_path").value == str(LLAMA31_8B)
    published = at.dataframe[1].value
    first = published.iloc[0]
    assert first["row as published"] == "64x H100, GBS 1024" and first["layout"] == "dp32 cp2 zero1 mb1 recompute none"
    assert first["measured"] == 10020.8 and first["metric"] == "tokens/s per GPU"
    assert first["simulated"] == pytest.approx(10020.8, rel=0.1)
    assert first["sequence (tokens)"] == 8192 and first["GPUs"] == 64


def test_published_like_finds_rows_of_the_same_hardware_gpus_and_size():
    from tuning.plan_published import published_like

    llama = published_like(8.03e9, 64, "dgx-h100", seq=8192)
    assert llama["id"].iloc[0] == "dgxc-l8-64" and set(llama["gpus"]) == {64}
    assert published_like(8.03e9, 64, "dgx-a100-80gb").empty  # another GPU
    assert published_like(8.03e9, 48, "dgx-h100").empty  # another GPU count
    assert published_like(30e9, 64, "dgx-h100", seq=8192)["id"].tolist()[:1] != ["dgxc-l8-64"]  # another size
    mpt = published_like(1.3e9, 8, "dgx-h100", seq=4096)
    assert mpt["seq"].iloc[0] == 4096 and mpt["seq"].tolist()[1:3] == [2048, 8192]  # the nearest length first


@pytest.mark.slow  # a second process (the CLI; a dry run)
def test_the_dry_run_of_the_top_layouts_draws_its_progress(tmp_path, monkeypatch):
    """Dry-run on demand: the top 2 layouts of the tiny job, each dry-run in a process (DDP ones too), the
    progress drawn before each dry run, each judged against the GPU memory."""
    import tuning.plan

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    at = _page(tmp_path, monkeypatch, path=str(tmp_path / "config.json"), top=8, **TINY)
    k = 2
    said: list[int] = []
    real = tuning.plan.dry_run_top

    def watched(plan, k, *, progress, **kwargs):
        def seen(pick, cfg):
            said.append(pick)
            progress(pick, cfg)
        return real(plan, k, progress=seen, **kwargs)

    monkeypatch.setattr(tuning.plan, "dry_run_top", watched)
    at.number_input(key="plan_dry_k").set_value(k)
    at.run()
    at.button(key="plan_dry_run").click()
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    checks = at.dataframe[-1].value
    assert list(checks["pick"]) == list(range(1, k + 1)) and set(checks["fits"]) == {"yes"}
    assert said == [1, 2]  # the progress is drawn before each layout the dry run plays
    assert list(checks["judged by"]) == ["dry run"] * k
    assert at.get("progress")[-1].proto.text == f"{k} of {k} judged"


def test_an_uploaded_config_json_ranks_as_its_file_does_and_its_export_carries_it(tmp_path, monkeypatch):
    from streamlit.delta_generator import DeltaGenerator

    from tuning.plan import make_plan
    from tuning.sim.hardware import load_cluster
    from tuning.sim.simulator import ModelSpec

    downloads: dict[str, str] = {}
    real = DeltaGenerator.download_button

    def recorded(self, label, data, *args, **kwargs):
        downloads[kwargs["file_name"]] = data
        return real(self, label, data, *args, **kwargs)

    monkeypatch.setattr(DeltaGenerator, "download_button", recorded)
    at = _page(tmp_path, monkeypatch, upload=json.dumps(TINY_LLAMA).encode(), **TINY)
    plan = make_plan(ModelSpec.from_hf(TINY_LLAMA, seq=64), load_cluster("dgx-h100"), gpus=4, global_batch=8,
                     target="yaml")
    shown = at.dataframe[0].value
    assert list(shown["iteration (s)"]) == list(plan.table["iteration_time_s"])
    assert "model_type: llama" in downloads["config.yaml"] and "num_key_value_heads: 4" in downloads["config.yaml"]


def test_bad_inputs_are_said_in_one_line(tmp_path, monkeypatch):
    at = _page(tmp_path, monkeypatch, rank=False, path=str(tmp_path / "missing.json"))
    assert [len(e.value.splitlines()) for e in at.error] == [1] and at.error[0].value.startswith("model: ")
    assert not [b for b in at.button if b.key == "plan_rank"]
    at = _page(tmp_path, monkeypatch, rank=False, gpus=100)  # old page: "zero-size array to reduction operation"
    assert [e.value for e in at.error] == ["GPUs=100: must fit in one node or fill whole nodes of dgx-h100 (a "
                                           "multiple of its 8 GPUs per node)"]
    at = _page(tmp_path, monkeypatch, rank=False, gpus=7)  # old page: nothing said before Rank layouts
    assert [e.value for e in at.error] == ["Global batch=512: must be a multiple of a data-parallel size this model "
                                           "can have on 7 GPUs (7; dp = GPUs / (tp x pp x cp)); change it or the GPUs"]
    at = _page(tmp_path, monkeypatch, rank=False, global_batch=4)  # `plan --global-batch 4 --gpus 64`'s note
    assert [c.value for c in at.caption if c.value.startswith("Global batch 4 on 64 GPUs")] == [
        "Global batch 4 on 64 GPUs: the data-parallel size divides it, so every layout has dp <= 4 and splits the "
        "model over the other GPUs"]
    at = _page(tmp_path, monkeypatch, gpus=1)  # Llama 3.1 8B at 8,192 tokens fits no H100 alone
    assert [e.value for e in at.error][0].startswith("no layout of this model fits in 85.5 GB per GPU on 1 GPUs")


@pytest.fixture
def server(tmp_path: Path):
    proc, url = start_dashboard(tmp_path / "home")
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=20)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian package `chromium` (apt-get install -y chromium); "
                    "no browser is downloaded")
def test_the_browser_ranks_a_small_job_on_the_plan_page(server, tmp_path):
    from playwright.sync_api import sync_playwright

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1500, "height": 2000})
        page.goto(f"{server}/plan")
        page.get_by_role("heading", name="Plan").wait_for(timeout=60_000)
        for label, value in (("config.json (a file, or a model folder holding one)", str(tmp_path / "config.json")),
                             ("GPUs", "4"), ("Global batch (sequences)", "8"),
                             ("Sequence length (tokens; empty: config.json's, up to 8192, or the preset's)", "64")):
            page.get_by_label(label).fill(value)
            page.get_by_label(label).press("Enter")
        page.get_by_role("button", name="Rank layouts").click()
        page.get_by_role("heading", name="Ranked layouts").wait_for(timeout=120_000)
        table = page.locator('[data-testid="stDataFrame"]').first
        table.wait_for(timeout=30_000)
        page.get_by_role("button", name="accelerate.yaml").wait_for(timeout=60_000)  # the last export drawn
        (REPO / "artifacts").mkdir(exist_ok=True)
        page.screenshot(path=str(REPO / "artifacts" / "plan-ranked.png"), full_page=True)
        assert table.bounding_box()["height"] > 100
        assert page.get_by_text("layouts of a 722K-parameter model at 64 tokens on 4 GPUs of dgx-h100").count() == 1
        browser.close()
