"""push_to_hub: what gets staged for the hub repo and what its card says, the repo ids it refuses and what it redacts
(the upload itself is not tested)."""

import json
import re

import pytest
import yaml

from headstart.heads import read_head_config
from headstart.scripts import cli
from headstart.scripts.export import push_to_hub
from headstart.scripts.export.push_to_hub import local_target_problem, main, stage
from tests.helpers import make_head

REPO = "acme/demo-eagle3"


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


def test_stage_holds_export_report_and_training_config(tiny_llama_from_dir, tmp_path):
    head_dir, report = make_run(tiny_llama_from_dir, tmp_path)
    out = stage(head_dir, REPO, "vllm", tmp_path / "staged", report, target_id="acme/tiny-llama").folder
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
    assert f"python -m scripts.export.push_to_hub --head <head-folder> --repo-id {REPO} --format vllm" in card
    assert str(tmp_path) not in card and str(head_dir) not in card  # no local path is published


def test_dry_run_prints_files_and_card_and_uploads_nothing(tiny_llama_from_dir, tmp_path, capsys):
    head_dir, _ = make_run(tiny_llama_from_dir, tmp_path)
    main(["--head", str(head_dir), "--repo-id", REPO, "--format", "speculators", "--dry-run"])
    printed = capsys.readouterr().out
    assert f"staged for {REPO}:" in printed and "model.safetensors" in printed and "training_config.yaml" in printed
    assert f"vllm serve {REPO}" in printed  # the card: the speculators folder names its verifier
    # The same settings as a config's push: section: headstart runs the same command on them.
    cli.main(["push", f"push.head={head_dir}", f"push.repo_id={REPO}", "push.format=speculators", "push.dry_run=true"])
    assert capsys.readouterr().out == printed


def test_a_report_folder_without_a_report_is_refused(tiny_llama_from_dir, tmp_path, capsys):
    head_dir, _ = make_run(tiny_llama_from_dir, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["--head", str(head_dir), "--repo-id", REPO, "--report", str(tmp_path / "empty"), "--dry-run"])
    assert exit_info.value.code == 2 and "no report.md, report.json or *.png" in capsys.readouterr().err


@pytest.mark.parametrize("link", ["report/report.json", "report/acceptance.png", "config.yaml"])
def test_links_leaving_the_named_folders_are_refused(tiny_llama_from_dir, tmp_path, capsys, link):
    run = tmp_path / "run"
    run.mkdir()
    head_dir, report = make_run(tiny_llama_from_dir, run)
    secret = tmp_path / ".env"
    secret.write_text("HF_TOKEN=hf_secret\n")
    (run / link).unlink()
    (run / link).symlink_to(secret)
    argv = ["--head", str(head_dir), "--repo-id", REPO, "--report", str(report), "--target-id", "acme/tiny-llama"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--dry-run"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and f"{run / link}" in captured.err and "leads outside" in captured.err
    assert "hf_secret" not in captured.out


def test_links_and_files_inside_the_report_folder_are_staged_as_regular_files(tiny_llama_from_dir, tmp_path):
    head_dir, report = make_run(tiny_llama_from_dir, tmp_path)
    (report / "plots").mkdir()
    (report / "acceptance.png").rename(report / "plots" / "acceptance.png")
    (report / "acceptance.png").symlink_to("plots/acceptance.png")  # a link that stays inside: staged
    out = stage(head_dir, REPO, "vllm", tmp_path / "staged", report, target_id="acme/tiny-llama").folder
    staged = out / "eval" / "acceptance.png"
    assert not staged.is_symlink() and staged.read_bytes() == b"\x89PNG fake"
    (report / "report.md").unlink()
    (report / "report.md").mkdir()  # not a regular file
    with pytest.raises(ValueError, match=r"report.md is not a regular file"):
        stage(head_dir, REPO, "vllm", tmp_path / "staged2", report, target_id="acme/tiny-llama")


def test_a_local_target_is_never_published(tiny_llama_from_dir, tmp_path, capsys):
    head_dir, report = make_run(tiny_llama_from_dir, tmp_path)
    local = read_head_config(head_dir).target  # the folder the head was trained on
    with pytest.raises(ValueError, match=f"the target {local} is a local folder: pass --target-id"):
        stage(head_dir, REPO, "speculators", tmp_path / "staged", report)
    with pytest.raises(ValueError, match="--target-id '/models/llama' is not a hub id"):
        stage(head_dir, REPO, "speculators", tmp_path / "staged2", report, target_id="/models/llama")
    out = stage(head_dir, REPO, "speculators", tmp_path / "staged3", report, target_id="acme/tiny-llama").folder
    for path in (p for p in out.rglob("*") if p.is_file()):
        text = path.read_bytes().decode("utf-8", "replace")
        assert local not in text and str(tmp_path) not in text, path
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == (
        "acme/tiny-llama"
    )
    # --dry-run still shows everything, and says the push would be refused
    main(["--head", str(head_dir), "--repo-id", REPO, "--dry-run"])
    captured = capsys.readouterr()
    assert f"staged for {REPO}:" in captured.out and "model.safetensors" in captured.out
    assert f"note: the target {local} is a local folder: pass --target-id" in captured.err


def test_a_target_of_no_name_is_refused_without_a_target_id():
    # stage() finds the head's own target when --target is not given; a head saved without one has none.
    assert local_target_problem(None, None) == (
        "the head records no target: pass --target-id ORG/NAME, the target as users load it"
    )


@pytest.mark.parametrize("repo_id", ["../../etc", "a/b/c", "acme", "acme/-x", "acme/x.", "acme/a..b", "ac me/x",
                                     "acme/" + "x" * 97])  # fmt: skip
def test_a_repo_id_the_hub_would_refuse_is_refused_before_staging(tiny_llama_from_dir, tmp_path, capsys, repo_id):
    head = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    with pytest.raises(SystemExit) as exit_info:
        push_to_hub.main(["--head", str(head), "--repo-id", repo_id, "--target-id", "acme/t", "--dry-run"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and f"--repo-id {repo_id!r} is not a hub id" in captured.err
    assert "staged for" not in captured.out


def test_push_redacts_url_credentials_and_local_paths_and_lists_them(tiny_llama_from_dir, tmp_path, capsys):
    run = tmp_path / "run"
    head = make_head(tiny_llama_from_dir, run, "eagle3")
    training = {
        "target": {"path": "/home/me/models/llama", "dtype": "bf16"},
        "data": {"source": "~/data/chat.jsonl", "format": "messages"},
        "regenerate": {"base_url": "http://user:s3cret-token@gpu-box:8000/v1", "model": "meta-llama/Llama-3"},
        "capture": {"base_url": "https://host/v1?api_key=sk-abc123&x=1"},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(training, sort_keys=False))
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("| method | tau |\n|---|---|\n| eagle3 | 2.4 |\n\ntarget /home/me/models/llama\n")
    (report / "report.json").write_text(json.dumps({"target": "/home/me/models/llama", "tau": 2.4}))
    argv = ["--head", str(head), "--repo-id", "acme/demo", "--target-id", "acme/t", "--report", str(report)]
    push_to_hub.main([*argv, "--dry-run"])
    printed = capsys.readouterr().out
    for secret in ("s3cret-token", "sk-abc123", "/home/me", "~/data"):
        assert secret not in printed, secret
    listed = printed.split("redacted (replaced in the staged files, never published):\n")[1].split("\n\n")[0]
    card, *others = listed.splitlines()
    assert re.fullmatch(r"  README.md: line \d+ \(local path\)", card)  # the card shows report.md
    assert others == [
        "  eval/report.json: target (local path)",
        "  eval/report.md: line 5 (local path)",
        "  training_config.yaml: target.path (local path)",
        "  training_config.yaml: data.source (local path)",
        "  training_config.yaml: regenerate.base_url (credential in a URL)",
        "  training_config.yaml: capture.base_url (credential in a URL)",
    ]
    staged = push_to_hub.stage(head, "acme/demo", "vllm", tmp_path / "staged", report, target_id="acme/t").folder
    config = yaml.safe_load((staged / "training_config.yaml").read_text())
    assert config["regenerate"] == {"base_url": "http://<redacted>@gpu-box:8000/v1", "model": "meta-llama/Llama-3"}
    assert config["target"]["path"] == "<local-path>" and config["target"]["dtype"] == "bf16"
    assert config["capture"]["base_url"] == "https://host/v1?api_key=<redacted>&x=1"
    for path in (p for p in staged.rglob("*") if p.is_file()):
        text = path.read_bytes().decode("utf-8", "replace")
        assert "s3cret" not in text and "/home/me" not in text and str(tmp_path) not in text, path


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_a_clean_push_redacts_nothing(tiny_llama_from_dir, tmp_path, fmt):
    # The card's serve commands, links and tables hold no path from the root: redaction must leave them alone.
    head = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    staged = push_to_hub.stage(head, "acme/demo", fmt, tmp_path / "staged", target_id="acme/t")
    assert staged.redacted == [] and "<local-path>" not in (staged.folder / "README.md").read_text()
