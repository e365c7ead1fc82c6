"""push_to_hub publishes no secret and no local path that is not in a URL: every staged file goes through one rule
set (``core.redact``), each find is listed in the dry run by file, key and kind, and a file that cannot be rewritten
is refused naming it. The secrets here are made-up strings of the real shapes (AWS's documented example pair)."""

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from headstart.scripts.export import push_to_hub
from tests.helpers import make_head

OPENAI = "sk-proj-" + "Fake0Key1For2Tests3" * 2
HF = "hf_" + "FAKEtoken" * 4
BEARER = "eyFake.Bearer-Token_0123456789"
AWS_ID, AWS_SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SECRETS = (OPENAI, HF, BEARER, AWS_ID, AWS_SECRET, "/home/me", "~bob", "Users\\me", "C:\\", "file:")
LISTED = "redacted (replaced in the staged files, never published):\n"


def run_folder(target, tmp_path):
    run = tmp_path / "run"
    head = make_head(target, run, "eagle3")
    training = {
        "regenerate": {"api_key": OPENAI, "model": "meta-llama/Llama-3", "note": f"pushed with {HF}"},
        "capture": {"headers": f"Authorization: Bearer {BEARER}"},
        "aws": {"access_key_id": AWS_ID, "secret_access_key": AWS_SECRET},
        "data": {"source": "file:///home/me/data/chat.jsonl", "cache": "key:/home/me/cache"},
        "target": {"path": "~bob/models/llama", "tokenizer": "C:\\Users\\me\\tok"},
        "layers": {"/home/me/aux.pt": 3, "max_new_tokens": 24, "pad_token": "<pad>"},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(training, sort_keys=False))
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text(
        f"| method | tau |\n|---|---|\n| eagle3 | 2.4 |\n\nrun as HF_TOKEN={HF} python -m eval.acceptance\n"
        f"AWS pair {AWS_ID} {AWS_SECRET}\nfrom C:\\Users\\me\\bench.jsonl\n"
    )
    (report / "report.json").write_text(json.dumps({"/home/me/bench.jsonl": {"tau": 2.4}, "tau": 2.4}))
    return head, report


def test_secrets_and_local_paths_outside_urls_are_redacted_everywhere_and_listed(tiny_llama_from_dir, tmp_path, capsys):
    head, report = run_folder(tiny_llama_from_dir, tmp_path)
    argv = ["--head", str(head), "--repo-id", "acme/demo", "--target-id", "acme/t", "--report", str(report)]
    push_to_hub.main([*argv, "--dry-run"])
    printed = capsys.readouterr().out
    for secret in SECRETS:
        assert secret not in printed, secret
    listed = printed.split(LISTED)[1].split("\n\n")[0].splitlines()
    assert [line for line in listed if not line.startswith("  README.md")] == [
        "  eval/report.json: <local-path> (local path in a key)",
        "  eval/report.md: line 5 (secret)",
        "  eval/report.md: line 6 (secret)",
        "  eval/report.md: line 7 (local path)",
        "  training_config.yaml: regenerate.api_key (secret)",
        "  training_config.yaml: regenerate.note (secret)",
        "  training_config.yaml: capture.headers (secret)",
        "  training_config.yaml: aws.access_key_id (secret)",
        "  training_config.yaml: aws.secret_access_key (secret)",
        "  training_config.yaml: data.source (local path)",
        "  training_config.yaml: data.cache (local path)",
        "  training_config.yaml: target.path (local path)",
        "  training_config.yaml: target.tokenizer (local path)",
        "  training_config.yaml: layers.<local-path> (local path in a key)",
    ]
    staged = push_to_hub.stage(head, "acme/demo", "vllm", tmp_path / "staged", report, target_id="acme/t").folder
    for path in (p for p in staged.rglob("*") if p.is_file()):
        text = path.read_bytes().decode("utf-8", "replace")
        assert not [s for s in SECRETS if s in text] and str(tmp_path) not in text, path
    config = yaml.safe_load((staged / "training_config.yaml").read_text())
    assert config["regenerate"] == {
        "api_key": "<redacted>",
        "model": "meta-llama/Llama-3",
        "note": "pushed with <redacted>",
    }
    assert config["capture"]["headers"] == "Authorization: Bearer <redacted>"
    assert config["data"] == {"source": "<local-path>", "cache": "key:<local-path>"}
    assert config["layers"] == {"<local-path>": 3, "max_new_tokens": 24, "pad_token": "<pad>"}  # only the path
    assert "run as HF_TOKEN=<redacted> python -m eval.acceptance" in (staged / "eval" / "report.md").read_text()
    # The card shows report.md: its three lines, where they landed in the card
    line = (staged / "README.md").read_text().splitlines().index("run as HF_TOKEN=<redacted> python -m eval.acceptance")
    assert [entry for entry in listed if entry.startswith("  README.md")] == [
        f"  README.md: line {line + 1} (secret)",
        f"  README.md: line {line + 2} (secret)",
        f"  README.md: line {line + 3} (local path)",
    ]


def test_files_that_cannot_be_rewritten_are_refused_naming_file_and_key(tmp_path):
    folder = tmp_path / "staged"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors", metadata={"format": "pt", "src": "/home/me/x"})
    with pytest.raises(ValueError, match=r"^model.safetensors: its header's __metadata__.src holds a local path"):
        push_to_hub.redact_folder(folder)
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "plot.png").write_bytes(b"\x89PNG\x00\xff" + HF.encode() + b"\x00")
    with pytest.raises(ValueError, match=r"^plot.png: a binary file that holds a secret"):
        push_to_hub.redact_folder(folder)
    (folder / "plot.png").write_bytes(b"\x89PNG\x00\xff/usr/lib\x00")  # any bytes hold '/' runs: not a path
    assert push_to_hub.redact_folder(folder) == []
