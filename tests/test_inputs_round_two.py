"""Inputs from elsewhere, round two (issue #31, items 8-10, 14, 15): tree.json through one schema wherever it is read,
the flags through their config section's ranges, empty bench messages, hub ids, what push_to_hub publishes, and
the launcher's own flags. Each test failed before its fix."""

import json
import re

import pytest
import yaml
from conftest import make_head
from transformers import LlamaForCausalLM

from headstart.core.errors import DataError
from headstart.data_recipes.bench import load_bench
from headstart.decoding.tree_config import (
    TreeSpec,
    chain_choices,
    check_tree_vocab,
    head_tree_configs,
    load_tree_config,
)
from headstart.eval import acceptance, autotune
from headstart.heads import read_head_folder
from headstart.scripts import cli
from headstart.scripts.export import push_to_hub
from headstart.scripts.export.card import served_schedule, tree_card_section

DYNAMIC = {"shape": "dynamic", "choices": None, "depth": 3, "top_k": 4, "total_tokens": 8}
STATIC = {"shape": "static", "choices": [[0], [1], [0, 0]], "depth": 2, "top_k": 2, "total_tokens": 3}


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    """tiny_llama() (vocabulary 300) loaded from its folder: a head made on it names its target, as trained ones do."""
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (DYNAMIC | {"depth": -3}, "depth must be >= 1, got -3"),
        (DYNAMIC | {"top_k": 0}, "top_k must be >= 1, got 0"),
        (DYNAMIC | {"total_tokens": -5}, "total_tokens must be >= 1, got -5"),
        (DYNAMIC | {"min_confidence": 5}, "min_confidence must be <= 1.0, got 5"),
        (DYNAMIC | {"min_confidence": "high"}, "min_confidence must be float, got 'high' (str)"),
        (DYNAMIC | {"depth": True}, "depth must be int, got True (bool)"),
        (DYNAMIC | {"min_confidance": 0.5}, "unknown key 'min_confidance' (known: "),
        (DYNAMIC | {"choices": [[0]]}, "choices: a dynamic tree has null, got [[0]]"),
        (STATIC | {"choices": [["a"]]}, "choices[0][0] must be int, got 'a' (str)"),
        (STATIC | {"choices": [[0], [-1]]}, "choices[1][0] must be >= 0, got -1"),
        (STATIC | {"choices": [[100000]]}, "top_k must be 100001 (the highest rank in choices, plus one), got 2"),
        (STATIC | {"choices": [[0], [1], [1, 0, 0]]}, "choices [1, 0, 0] lacks its parent path [1, 0]"),
        (STATIC | {"depth": 5}, "depth must be 2 (the longest path in choices), got 5"),
        (STATIC | {"choices": None}, "choices: a static tree needs a non-empty list of rank paths, got None"),
        (STATIC | {"predicted_tau": 2.0}, "come together, got only ['predicted_tau']"),
        (STATIC | {"machine": None}, "machine must be str, got None (NoneType)"),
        # A bool is an int to isinstance: the depth of a schedule entry must be an int, as vLLM reads it.
        (STATIC | {"depth_per_batch_size": [[1, 8, True]]}, r"depth_per_batch_size: [1, 8, True] is not [first"),
    ],
)
def test_a_tree_json_is_read_through_one_schema_naming_file_key_and_value(tmp_path, tree, message):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(ValueError) as err:
        load_tree_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), err.value
    # The model card reads a head folder's tree.json through the same check (scripts.export copies it in).
    for card_reader in (tree_card_section, served_schedule):
        with pytest.raises(ValueError, match="^" + str(path)):
            card_reader(tmp_path)


def test_a_tree_config_given_in_code_is_checked_too():
    with pytest.raises(ValueError, match=r"^tree config: top_k must be >= 1, got 0"):
        TreeSpec.from_config(DYNAMIC | {"top_k": 0})
    assert TreeSpec.from_config(STATIC).choices == [[0], [1], [0, 0]]
    assert TreeSpec.from_config(TreeSpec.static(chain_choices(3)).config()).depth == 3


def test_a_rank_past_the_drafters_vocabulary_is_refused_naming_the_file(target, tmp_path):
    head = make_head(target, tmp_path, "eagle3")  # draft vocabulary 200
    choices = [[0], [200]]
    (head / "tree.json").write_text(json.dumps({"shape": "static", "choices": choices, "depth": 1, "top_k": 201,
                                                "total_tokens": 2}))  # fmt: skip
    with pytest.raises(ValueError, match=rf"{head / 'tree.json'}: choices \[200\]: rank 200 is past the 200 tokens"):
        head_tree_configs({"eagle3": read_head_folder(head)}, None, ["eagle3"])
    with pytest.raises(ValueError, match=r"x.json: top_k 301 is past the 300 tokens the model t drafts from"):
        check_tree_vocab(DYNAMIC | {"top_k": 301}, 300, "x.json", "the model t")


def test_a_head_folders_own_tree_json_fails_before_any_model_loads(target, tmp_path):
    # The user never named the file: it sits in the head folder. Neither the target nor the bench exists, so a
    # run that got as far as loading either would fail with another error.
    head = make_head(target, tmp_path, "eagle3")
    (head / "tree.json").write_text(json.dumps(DYNAMIC | {"depth": -3}))
    argv = ["--target", str(tmp_path / "no-target"), "--head", str(head), "--method", "eagle3"]
    with pytest.raises(ValueError, match=rf"^{head / 'tree.json'}: depth must be >= 1, got -3"):
        acceptance.main(argv + ["--bench", str(tmp_path / "no-bench.jsonl"), "--out", str(tmp_path / "r")])


@pytest.mark.parametrize(
    ("module", "flags", "message"),
    [
        (acceptance, ["--top-p", "2"], "--top-p must be <= 1, got 2.0"),
        (acceptance, ["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (acceptance, ["--dtype", "fp64"], "--dtype must be one of"),
        (autotune, ["--max-depth", "-2"], "--max-depth must be >= 1, got -2"),
        (autotune, ["--batch-sizes", "0,2"], "--batch-sizes[0] must be >= 1, got 0"),
        (autotune, ["--offset", "-1"], "--offset must be >= 0, got -1"),
    ],
)
def test_the_flags_have_the_ranges_of_their_config_section(module, flags, message, capsys):
    required = {acceptance: ["--method", "vanilla", "--bench", "b"], autotune: ["--head", "h"]}[module]
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--target", "t", "--out", "o", *required, *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_bench_message_with_empty_content_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}  # a reference slot
    empty = {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": "Hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(empty) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: message 0 \(system\) has empty 'content'"):
        load_bench(path)
    path.write_text(json.dumps(good) + "\n")
    assert load_bench(path)[0].turns == ["Hi"]


def test_a_prompt_longer_than_the_targets_positions_is_refused_before_decoding(tmp_path):
    from conftest import TARGET

    bench = tmp_path / "long.jsonl"
    long_question = "How many apples? " * 400  # ~1,600 tokens against the bundled target's 1,024 positions
    bench.write_text(json.dumps({"question_id": 7, "category": "math", "turns": [long_question]}) + "\n")
    flags = ["--target", str(TARGET), "--method", "vanilla", "--bench", str(bench), "--max-new-tokens", "8"]
    with pytest.raises(ValueError, match=r"bench item 7 \(math\) can reach \d+ tokens .* past the target's 1024"):
        acceptance.main([*flags, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("repo_id", ["../../etc", "a/b/c", "acme", "acme/-x", "acme/x.", "acme/a..b", "ac me/x",
                                     "acme/" + "x" * 97])  # fmt: skip
def test_a_repo_id_the_hub_would_refuse_is_refused_before_staging(target, tmp_path, capsys, repo_id):
    head = make_head(target, tmp_path, "eagle3")
    with pytest.raises(SystemExit) as exit_info:
        push_to_hub.main(["--head", str(head), "--repo-id", repo_id, "--target-id", "acme/t", "--dry-run"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and f"--repo-id {repo_id!r} is not a hub id" in captured.err
    assert "staged for" not in captured.out


def test_push_redacts_url_credentials_and_local_paths_and_lists_them(target, tmp_path, capsys):
    run = tmp_path / "run"
    head = make_head(target, run, "eagle3")
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


def test_the_launcher_refuses_a_process_count_below_one_naming_the_flag(monkeypatch, capsys):
    def execv(*argv):
        raise AssertionError(f"torchrun was started: {argv}")

    monkeypatch.setattr(cli.os, "execv", execv)  # torchrun must never see the count (it fails on 0 with no word)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", "configs/demo-eagle3.yaml", "--nproc-per-node", "0"])
    assert exit_info.value.code == 2 and "argument --nproc-per-node: must be >= 1, got 0" in capsys.readouterr().err


def test_the_launcher_refuses_an_empty_out_naming_the_key(target, tmp_path, capsys, monkeypatch):
    head = make_head(target, tmp_path, "eagle3")
    monkeypatch.chdir(tmp_path)  # an empty out is the folder the command runs in
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", f"export.head={head}", "export.format=vllm", "export.out="])
    assert exit_info.value.code == 2 and "export.out must name a folder, got ''" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_a_clean_push_redacts_nothing(target, tmp_path, fmt):
    # The card's serve commands, links and tables hold no path from the root: redaction must leave them alone.
    head = make_head(target, tmp_path, "eagle3")
    staged = push_to_hub.stage(head, "acme/demo", fmt, tmp_path / "staged", target_id="acme/t")
    assert staged.redacted == [] and "<local-path>" not in (staged.folder / "README.md").read_text()
