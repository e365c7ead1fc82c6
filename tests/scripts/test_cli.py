"""The headstart command: every verb and its help, config errors before any model loads, each flag section equal
to its command's flags and refused outside its ranges, the launcher's own flags, and the resolved config beside
what each verb wrote."""

import argparse
import json
import shlex
import subprocess
import sys
import typing
from importlib import import_module
from typing import Literal

import pytest
import tomllib
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.core.config_files import ConfigError, load_config
from headstart.data_recipes.settings import RegenerateConfig
from headstart.eval import acceptance, autotune
from headstart.eval.acceptance import Eval
from headstart.heads import HEAD_TYPES, build_head, load_head, trainers
from headstart.scripts import cli
from headstart.scripts.export.import_head import ImportHead
from headstart.scripts.pipeline_config import COMMAND_CONFIGS, COMMAND_FLAGS
from tests.helpers import (
    REPO,
    TARGET,
    base_config,
    head_weights,
    make_head,
    resolve,
    subprocess_env,
    world_of_one,
    write_config,
)

VERBS = ["fetch-target", "regenerate", "capture", "train", "eval", "autotune", "export", "import", "push", "demo"]
VERBS += ["verify-engines"]
FLAG_VERBS = [verb for verb in VERBS if cli.VERBS[verb].section is not None]
GSM8K_TEST = REPO / "assets" / "data" / "gsm8k_test.jsonl"


def test_help_lists_every_verb_on_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: headstart ")
    lines = out.split("verbs:\n")[1].splitlines()
    assert [line.split()[0] for line in lines] == VERBS
    assert all(line.endswith(cli.VERBS[verb].summary) for verb, line in zip(VERBS, lines))


# What each verb's own help must show: the passthrough verbs' module options, train's launcher options.
HELP_SHOWS = {
    "fetch-target": ["--list", "--cache"],
    "regenerate": ["--config", "overrides"],
    "capture": ["--config", "--on-error"],
    "train": ["--config", "--nproc-per-node", "--nnodes", "--rdzv-endpoint", "eagle3: train/eagle.py"],
    "demo": ["--config", "--stages"],
}


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_has_its_own_help(verb, capsys):
    argv0 = sys.argv[0]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([verb, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith(f"usage: headstart {verb} ")
    section = cli.VERBS[verb].section
    shows = HELP_SHOWS.get(verb) or ["--config", *(f"{section}.{key}:" for key in COMMAND_FLAGS[section].model_fields)]
    assert [s for s in shows if s not in out] == []
    assert sys.argv[0] == argv0  # the usage name is put back


@pytest.mark.parametrize(
    ("verb", "override", "message"),
    [
        (
            "capture",
            "data.limt=2",
            "unknown key data.limt (known: format, image_dir, limit, max_length, on_error, over_length, source)",
        ),
        ("regenerate", "regenerate.top_p=0", "regenerate.top_p must be > 0, got 0"),
        ("train", "train.lrr=1e-3", "unknown key train.lrr (known: attention, batch_size, betas,"),
        ("eval", "eval.limit=0", "eval.limit must be >= 1, got 0"),
        ("export", "export.format=vlm", "export.format must be one of 'vllm', 'sglang', 'speculators' or 'medusa'"),
    ],
)
def test_a_config_error_stops_the_verb_before_any_model_loads(verb, override, message, gsm8k_file, tmp_path, capsys):
    # One file for every stage; its target does not exist, so a verb that got as far as loading it would fail
    # with a load error, not the config's.
    missing = tmp_path / "no-such-target"
    config = base_config(missing, gsm8k_file, tmp_path / "shards", tmp_path / "run", "eagle3")
    config["regenerate"] = {"out": str(tmp_path / "regen.jsonl"), "max_new_tokens": 8}
    config["eval"] = {"target": str(missing), "method": ["vanilla"], "bench": str(gsm8k_file), "out": str(tmp_path)}
    config["export"] = {"head": str(tmp_path / "run" / "head"), "format": "vllm", "out": str(tmp_path / "export")}
    path = write_config(tmp_path / "all.yaml", config)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([verb, "--config", str(path), override])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"headstart {verb}: {path}: invalid ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.yaml"]  # nothing written


class _Parser(Exception):
    """Raised with the parser a command's main() built, as it starts to parse."""


def command_parser(module, monkeypatch) -> argparse.ArgumentParser:
    def catch(parser, *args, **kwargs):
        raise _Parser(parser)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(_Parser) as caught:
            import_module(module).main([])
    return caught.value.args[0]


@pytest.mark.parametrize("verb", FLAG_VERBS)
def test_each_flag_section_has_its_commands_flags_defaults_and_choices(verb, monkeypatch):
    section = COMMAND_FLAGS[cli.VERBS[verb].section]
    parser = command_parser(cli.VERBS[verb].module, monkeypatch)
    actions = {a.dest: a for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS}
    assert set(actions) == set(section.model_fields)
    for name, field in section.model_fields.items():
        action = actions[name]
        if name in section.positional:
            assert action.option_strings == [], name
        else:
            assert "--" + name.replace("_", "-") in action.option_strings, name
        assert action.required == field.is_required(), name
        assert action.default == argparse.SUPPRESS, name  # a flag left out: the model's default, declared once
        if not field.is_required():
            assert f"default: {field.default if not isinstance(field.default, list) else ''}" in action.help, name
        assert (action.nargs == 0) == (field.annotation is bool), name  # a yes/no flag
        for choice in typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else ():
            assert str(choice) in action.help, name  # the choices are in the help; the model checks them


# Every key set, none to its default: the flags carry each one.
EVERY_KEY = {
    "eval": {
        "target": "t", "head": ["h1", "h2"], "draft": "d", "allow_other_tokenizer": True,
        "method": ["vanilla", "eagle3"], "bench": "b", "prompt_format": "raw", "limit": 3, "per_group": 2,
        "max_new_tokens": 7, "temperature": 0.5, "temperatures": [0.0, 1.0],
        "top_p": 0.9, "top_k": 4, "tree": "static", "top_k_draft": 2, "depth": 3, "total_tokens": 9, "exit_layer": 2,
        "min_confidence": 0.25,
        "seed": 5, "device": "cpu", "dtype": "bf16", "tp_size": 2, "kv_cache": "static", "attn_implementation": "eager",
        "out": "o",
    },
    "autotune": {
        "target": "t", "head": "h", "allow_other_tokenizer": True, "bench": "b", "prompt_format": "chat", "offset": 2,
        "calibration": 3,
        "heldout": 4, "max_new_tokens": 5, "max_nodes": 6, "max_depth": 7, "comb_width": 2, "batch_size": 4,
        "batch_sizes": [2, 4], "repeats": 1, "device": "cpu", "dtype": "bf16", "tp_size": 2, "seed": 1, "out": "o",
        "write_head": True, "exit_layers": [2], "attn_implementation": "eager",
    },
}  # fmt: skip
REQUIRED_ONLY = {
    "eval": {"target": "t", "method": ["vanilla"], "bench": "b", "out": "o"},
    "autotune": {"target": "t", "head": "h", "out": "o"},
}
EXCLUSIVE = {"autotune": {"draft", "self_spec"}}  # EVERY_KEY tunes a head: a draft model or self-spec is another run
SELF_SPEC = {
    "eval": REQUIRED_ONLY["eval"],
    "autotune": {"target": "t", "self_spec": True, "exit_layers": [1, 3], "out": "o"},
}


@pytest.mark.parametrize(
    "given", [EVERY_KEY, REQUIRED_ONLY, SELF_SPEC], ids=["every-key", "required-only", "self-spec"]
)
@pytest.mark.parametrize("section", ["eval", "autotune"])
def test_a_section_goes_through_its_commands_flags_and_back_unchanged(section, given):
    values = resolve({section: given[section]}, COMMAND_CONFIGS[section])[section]
    if given is EVERY_KEY:
        fields = COMMAND_FLAGS[section].model_fields
        assert set(given[section]) == set(fields) - EXCLUSIVE.get(section, set())
        assert [k for k, v in given[section].items() if v == fields[k].default] == []
    settings = import_module(cli.VERBS[section].module).parse_args(as_argv(values))
    assert settings.as_config() == {section: values}


def test_autotune_takes_exactly_one_draft_source():
    for section in ({"target": "t", "out": "o"}, {"target": "t", "head": "h", "self_spec": True, "out": "o"}):
        with pytest.raises(ConfigError, match="give exactly one of head, draft and self_spec"):
            resolve({"autotune": section}, COMMAND_CONFIGS["autotune"])


def as_argv(values: dict) -> list[str]:
    """A section's values as flags: a list comma-joined, true the bare flag, false and null left out."""
    argv = []
    for name, value in values.items():
        if value is None or value is False or value == []:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return argv


def test_import_takes_its_checkpoint_as_a_positional_argument_and_from_as_its_kind():
    parser = ImportHead.parser("import", "")
    settings, _ = ImportHead.parse_flags(parser, ["--from", "eagle3", "pub", "--out", "o", "--target", "t"])
    assert settings.as_config() == {"import_head": {"kind": "eagle3", "src": "pub", "out": "o", "overwrite": False,
                                                    "target": "t"}}  # fmt: skip
    repeated, _ = Eval.parse_flags(Eval.parser("eval", ""), ["--target", "t", "--method", "vanilla", "--bench", "b",
                                                             "--out", "o", "--head", "a,b", "--head", "c"])  # fmt: skip
    assert repeated.head == ["a", "b", "c"]


def test_headstart_eval_writes_the_report_and_the_config_the_flags_write_too(tmp_path):
    path = write_config(
        tmp_path / "eval.yaml",
        {"eval": {"target": str(TARGET), "method": ["vanilla", "ngram"], "bench": str(GSM8K_TEST), "out": "x"}},
    )
    overrides = ["eval.limit=2", "eval.max_new_tokens=16", f"eval.out={tmp_path / 'cli'}"]
    cli.main(["eval", "--config", str(path), *overrides])
    resolved = resolve(load_config(path, overrides), COMMAND_CONFIGS["eval"])["eval"]
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert (report["prompts"], report["max_new_tokens"], set(report["methods"])) == (2, 16, {"vanilla", "ngram"})
    assert report["methods"]["ngram"]["greedy_identical"] is True
    assert yaml.safe_load((tmp_path / "cli" / "eval_config.yaml").read_text()) == {"eval": resolved}

    # The same run through the flags: the same settings saved, the same decoding.
    flags = ["--target", str(TARGET), "--method", "vanilla,ngram", "--bench", str(GSM8K_TEST), "--limit", "2"]
    acceptance.main([*flags, "--max-new-tokens", "16", "--out", str(tmp_path / "flags")])
    saved = yaml.safe_load((tmp_path / "flags" / "eval_config.yaml").read_text())
    assert saved == {"eval": resolved | {"out": str(tmp_path / "flags")}}
    again = json.loads((tmp_path / "flags" / "report.json").read_text())["methods"]
    for method, entry in report["methods"].items():
        assert (again[method]["tau"], again[method]["new_tokens"]) == (entry["tau"], entry["new_tokens"]), method


def test_the_demo_eval_config_holds_the_demo_eval_stage_settings():
    stage = next(s for s in load_config(REPO / "configs" / "demo.yaml")["stages"] if s["name"] == "eval")
    command = shlex.split(stage["cmd"])
    assert command[1:3] == ["-m", "eval.acceptance"]
    demo_eval = resolve(load_config(REPO / "configs" / "demo-eval.yaml"), COMMAND_CONFIGS["eval"])
    assert acceptance.parse_args(command[3:]).as_config() == {"eval": demo_eval["eval"]}


def test_headstart_regenerate_saves_the_resolved_config_beside_its_output(tiny_target_dir, gsm8k_file, tmp_path):
    out = tmp_path / "regen.jsonl"
    config = {
        "target": {"path": str(tiny_target_dir), "device": "cpu"},
        "data": {"source": str(gsm8k_file), "format": "gsm8k", "limit": 2},
        "regenerate": {"out": str(out), "max_new_tokens": 4},
    }
    cli.main(["regenerate", "--config", str(write_config(tmp_path / "regen.yaml", config)), "regenerate.seed=3"])
    assert len(out.read_text().splitlines()) == 2
    saved = yaml.safe_load((tmp_path / "regen.jsonl.config.yaml").read_text())
    assert saved == resolve(config | {"regenerate": config["regenerate"] | {"seed": 3}}, RegenerateConfig)
    assert saved["regenerate"]["temperature"] == 0.0 and saved["target"]["dtype"] == "fp32"  # the defaults too


def test_headstart_export_and_import_take_their_settings_from_overrides_alone(tiny_target_dir, tmp_path):
    target, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_target_dir),
        AutoTokenizer.from_pretrained(tiny_target_dir),
    )
    head = build_head({"type": "eagle3", "layer_ids": [1, 3, 4], "draft_vocab_size": 100}, target, tokenizer)
    head.save_pretrained(tmp_path / "head")
    export = ["export", f"export.head={tmp_path / 'head'}", "export.format=vllm", f"export.out={tmp_path / 'vllm'}"]
    cli.main(export)
    files = sorted(p.name for p in (tmp_path / "vllm").iterdir())
    assert files == ["README.md", "config.json", "export_config.yaml", "model.safetensors"]
    saved = yaml.safe_load((tmp_path / "vllm" / "export_config.yaml").read_text())
    assert saved["export"] == {
        "head": str(tmp_path / "head"), "format": "vllm", "out": str(tmp_path / "vllm"), "overwrite": False,
        "target": None, "parity": None, "allow_other_tokenizer": False, "stitch": False,
    }  # fmt: skip
    cli.main(export)  # an earlier export, its config included, is replaced without --overwrite

    back = tmp_path / "back"
    cli.main(["import", "import_head.kind=eagle3", f"import_head.src={tmp_path / 'vllm'}", f"import_head.out={back}",
              f"import_head.target={tiny_target_dir}"])  # fmt: skip
    original, imported = head.state_dict(), load_head(back, target).state_dict()
    assert original.keys() == imported.keys() and all(torch.equal(original[k], imported[k]) for k in original)


def test_headstart_autotune_saves_its_settings_beside_the_tree(tiny_target_dir, gsm8k_file, tmp_path, one_thread):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    build_head({"type": "eagle3", "layer_ids": [0, 2, 4], "draft_vocab_size": 100}, target, tokenizer).save_pretrained(
        tmp_path / "head"
    )
    settings = {
        "target": str(tiny_target_dir), "head": str(tmp_path / "head"), "bench": str(gsm8k_file), "calibration": 1,
        "heldout": 1, "max_new_tokens": 8, "max_nodes": 6, "max_depth": 3, "comb_width": 2, "repeats": 1,
        "batch_sizes": [1], "out": str(tmp_path / "at"),
    }  # fmt: skip
    cli.main(["autotune", "--config", str(write_config(tmp_path / "at.yaml", {"autotune": settings}))])
    resolved = resolve({"autotune": settings}, COMMAND_CONFIGS["autotune"])
    assert yaml.safe_load((tmp_path / "at" / "autotune_config.yaml").read_text()) == resolved
    assert json.loads((tmp_path / "at" / "tree.json").read_text())["total_tokens"] <= 6


def train_config(tiny_target_dir, gsm8k_file, tmp_path, head_type):
    config = base_config(tiny_target_dir, gsm8k_file, tmp_path / "unused", tmp_path / "run", head_type)
    config["train"] |= {"online_capture": True, "max_steps": 2, "eval_every": 0}
    return write_config(tmp_path / f"{head_type}.yaml", config)


@pytest.mark.parametrize("head_type", ["eagle3", "medusa"])
def test_headstart_train_runs_the_recipe_of_the_head_type(head_type, tiny_target_dir, gsm8k_file, tmp_path,
                                                          monkeypatch, one_thread):  # fmt: skip
    # The other recipe would refuse the config: "head.type 'medusa' is trained by train/medusa.py".
    path = train_config(tiny_target_dir, gsm8k_file, tmp_path, head_type)
    world_of_one(monkeypatch)
    cli.main(["train", "--config", str(path), "train.seed=4"])
    head = load_head(tmp_path / "run" / "head", AutoModelForCausalLM.from_pretrained(tiny_target_dir))
    assert head.config.type == head_type
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (saved["head"]["type"], saved["train"]["seed"], saved["train"]["max_steps"]) == (head_type, 4, 2)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["split"] == "train"] == [1, 2]


@pytest.mark.slow
def test_headstart_train_on_two_processes_execs_torchrun_and_trains_the_same_head(
    tiny_target_dir, gsm8k_file, tmp_path, monkeypatch, one_thread
):
    path = train_config(tiny_target_dir, gsm8k_file, tmp_path, "eagle")
    two, one = tmp_path / "two", tmp_path / "one"
    command = [sys.executable, "-m", "scripts.cli", "train", "--config", str(path), "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, f"train.out_dir={two}"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    world_of_one(monkeypatch)
    cli.main(["train", "--config", str(path), f"train.out_dir={one}"])
    # Two ranks each kept their ZeRO optimizer shard; one process, one shard.
    assert [p.name for p in two.rglob("*zero_pp_rank_1_*")] and not list(one.rglob("*zero_pp_rank_1_*"))
    for name, weight in head_weights(one).items():
        torch.testing.assert_close(head_weights(two)[name], weight, atol=1e-5, rtol=0, msg=name)


def test_every_head_type_has_a_training_recipe():
    assert set(trainers()) == set(HEAD_TYPES)
    assert all(callable(import_module(f"train.{trainer}").main) for trainer in set(trainers().values()))


def test_pyproject_declares_the_headstart_console_script():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"headstart": "headstart.scripts.cli:main"}
    module, _, name = scripts["headstart"].partition(":")
    assert getattr(import_module(module), name) is cli.main


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


def test_the_launcher_refuses_a_process_count_below_one_naming_the_flag(monkeypatch, capsys):
    def execv(*argv):
        raise AssertionError(f"torchrun was started: {argv}")

    monkeypatch.setattr(cli.os, "execv", execv)  # torchrun must never see the count (it fails on 0 with no word)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", "configs/demo-eagle3.yaml", "--nproc-per-node", "0"])
    assert exit_info.value.code == 2 and "argument --nproc-per-node: must be >= 1, got 0" in capsys.readouterr().err


def test_the_launcher_refuses_an_empty_out_naming_the_key(tiny_llama_from_dir, tmp_path, capsys, monkeypatch):
    head = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    monkeypatch.chdir(tmp_path)  # an empty out is the folder the command runs in
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", f"export.head={head}", "export.format=vllm", "export.out="])
    assert exit_info.value.code == 2 and "export.out must name a folder, got ''" in capsys.readouterr().err


@pytest.mark.parametrize("verb", FLAG_VERBS)
def test_each_flag_commands_help_renders(verb, monkeypatch):
    # argparse %-formats help strings: a description saying "within 2% of" broke verify-engines --help.
    parser = command_parser(cli.VERBS[verb].module, monkeypatch)
    assert parser.format_help().startswith("usage:")
