"""push_to_hub: what gets staged for the hub repo and what its card says (the upload itself is not tested)."""

import json

import pytest
from transformers import LlamaForCausalLM

from scripts.push_to_hub import main, stage
from tests.test_export import make_head, save_target

REPO = "acme/demo-eagle3"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return LlamaForCausalLM.from_pretrained(save_target(tmp_path_factory.mktemp("target"))).eval()


def make_run(target, tmp_path):
    """A training run folder as train/ leaves it: head/ and the resolved config.yaml beside it."""
    head_dir = make_head(target, tmp_path, "eagle3")
    (tmp_path / "config.yaml").write_text("head:\n  type: eagle3\n")
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("| method | acceptance length |\n|---|---|\n| eagle3 | 2.41 |\n")
    (report / "report.json").write_text(json.dumps({"acceptance_length": 2.41}))
    (report / "acceptance.png").write_bytes(b"\x89PNG fake")
    return head_dir, report


def test_stage_holds_export_report_and_training_config(target, tmp_path):
    head_dir, report = make_run(target, tmp_path)
    out = stage(head_dir, REPO, "vllm", tmp_path / "staged", report, target_id="acme/tiny-llama")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "config.json",
        "eval/acceptance.png",
        "eval/report.json",
        "eval/report.md",
        "model.safetensors",
        "training_config.yaml",
    ]
    card = (out / "README.md").read_text()
    assert f'"model": "{REPO}"' in card and "vllm serve acme/tiny-llama" in card
    assert f"--speculative-draft-model-path {REPO}" in card
    assert "| eagle3 | 2.41 |" in card and "![acceptance](eval/acceptance.png)" in card
    assert "[`report.json`](eval/report.json)" in card and "(training_config.yaml)" in card
    assert f"python -m scripts.push_to_hub --head {head_dir} --repo-id {REPO} --format vllm" in card


def test_dry_run_prints_files_and_card_and_uploads_nothing(target, tmp_path, capsys):
    head_dir, _ = make_run(target, tmp_path)
    main(["--head", str(head_dir), "--repo-id", REPO, "--format", "speculators", "--dry-run"])
    printed = capsys.readouterr().out
    assert f"staged for {REPO}:" in printed and "model.safetensors" in printed and "training_config.yaml" in printed
    assert f"vllm serve {REPO}" in printed  # the card: the speculators folder names its verifier


def test_a_report_folder_without_a_report_is_refused(target, tmp_path, capsys):
    head_dir, _ = make_run(target, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["--head", str(head_dir), "--repo-id", REPO, "--report", str(tmp_path / "empty"), "--dry-run"])
    assert exit_info.value.code == 2 and "no report.md, report.json or *.png" in capsys.readouterr().err
