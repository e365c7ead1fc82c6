"""The config: each command refuses a bad config, naming each problem by its dotted key, before it loads a model or
runs a stage; every bundled config resolves to the values it always has; the whole file is checked by ``headstart``
(``scripts.pipeline_config.PipelineConfig``), each command's own sections by the command."""

import ast
import json
import re
import typing
from pathlib import Path

import pytest
import yaml

from headstart.core.config_files import ConfigError, apply_overrides, load_config
from headstart.core.settings import SECTIONS, TaggedUnion, parse
from headstart.data_recipes import capture, regenerate
from headstart.data_recipes.formats import FORMATS
from headstart.data_recipes.settings import (
    Capture,
    CaptureConfig,
    Data,
    Generation,
    Regenerate,
    RegenerateConfig,
    Target,
)
from headstart.data_recipes.shards import read_manifest
from headstart.eval import acceptance
from headstart.heads import HEAD_TYPES, Head, HeadOptions
from headstart.heads.medusa import Lora
from headstart.heads.registry import head_options_models
from headstart.scripts import cli, demo
from headstart.scripts.demo import DemoConfig
from headstart.scripts.dev import build_demo_models
from headstart.scripts.dev.build_demo_models import BuildDemoModelsConfig, DemoModel, ModelTraining
from headstart.scripts.pipeline_config import COMMAND_CONFIGS, PipelineConfig
from headstart.train import eagle, medusa
from headstart.train.train_config import Metrics, Train, TrainConfig, Wandb, resolve_config
from tests.helpers import REPO, resolve, write_config

HEAD_OPTIONS = head_options_models()
# Which commands read each bundled config; the rest (the head configs) drive capture and training.
COMMANDS_OF = {
    "demo.yaml": [DemoConfig],
    "build-demo-models.yaml": [BuildDemoModelsConfig],
    "demo-regenerate.yaml": [RegenerateConfig],
    "demo-regenerate-engine.yaml": [RegenerateConfig],
    "real-smollm2.yaml": [DemoConfig],
    "real-smollm2-regenerate.yaml": [RegenerateConfig],
    "demo-eval.yaml": [COMMAND_CONFIGS["eval"]],
    # The MTP bench's training runs capture online (the target carried into MiMo's layout has no shards).
    "demo-mtp-pretrain.yaml": [TrainConfig, PipelineConfig],
    "demo-mtp.yaml": [TrainConfig, PipelineConfig],
}
# What every bundled config resolved to (defaults filled in) before the settings moved beside their commands
# (core/schema.py, 2026-11-25): a resolved value that changes is a changed run.
RESOLVED = json.loads((REPO / "tests" / "resolved_configs.json").read_text())


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_bundled_config_resolves_to_the_values_it_always_had(path):
    config, expected = load_config(path), RESOLVED[path.name]
    commands = COMMANDS_OF.get(path.name, [CaptureConfig, TrainConfig, PipelineConfig])
    for schema in commands:
        resolved = resolve(config, schema)
        assert resolved == {key: expected[key] for key in resolved}, schema.__name__
        assert set(config) & set(schema.model_fields) <= set(resolved)  # no section the command reads is lost
    if PipelineConfig in commands:  # the whole file: every section it has, resolved as before
        assert set(config) <= set(resolve(config, PipelineConfig))


def test_the_schema_knows_the_heads_and_formats_the_code_has():
    assert set(HEAD_OPTIONS) == set(HEAD_TYPES)
    assert all(HEAD_TYPES[name].head.options_model is options for name, options in HEAD_OPTIONS.items())
    union = next(arg for arg in typing.get_args(Head) if isinstance(arg, TaggedUnion))  # the head: section
    assert set(union.members().values()) == set(HEAD_OPTIONS.values())
    assert set(typing.get_args(Data.model_fields["format"].annotation)) == set(FORMATS)
    assert tuple(PipelineConfig.model_fields) == SECTIONS
    assert all(issubclass(options, HeadOptions) for options in HEAD_OPTIONS.values())


def test_one_error_lists_every_problem_by_its_dotted_key():
    config = load_config(REPO / "configs" / "demo-eagle3.yaml")
    config = apply_overrides(config, ["data.limt=2", "capture.shard_samples=-1", "train.lr=0", "head.ttt_decay=2"])
    with pytest.raises(ConfigError) as err:
        parse(config, PipelineConfig)  # the whole file, as headstart checks it before any verb
    assert str(err.value).splitlines() == [
        "invalid pipeline config:",
        "  unknown key data.limt (known: format, image_dir, limit, max_length, on_error, over_length, source)",
        "  capture.shard_samples must be >= 1, got -1",
        "  head.ttt_decay must be <= 1, got 2",
        "  train.lr must be > 0, got 0",
    ]
    with pytest.raises(ConfigError) as err:
        parse(config, CaptureConfig)  # the capture command: its own sections
    assert str(err.value).splitlines() == [
        "invalid capture config:",
        "  unknown key data.limt (known: format, image_dir, limit, max_length, on_error, over_length, source)",
        "  capture.shard_samples must be >= 1, got -1",
    ]


def test_a_section_that_no_command_reads_is_refused_by_every_command():
    config = apply_overrides(load_config(REPO / "configs" / "demo-eagle3.yaml"), ["trian.lr=1"])
    for schema in (CaptureConfig, TrainConfig, PipelineConfig):
        with pytest.raises(ConfigError, match=r"unknown section 'trian' \(known: autotune, capture, data, eval"):
            parse(config, schema)


def test_defaults_fill_in_and_yaml_exponents_read_as_floats(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "target: {path: t}\ndata: {source: d.jsonl, format: gsm8k, max_length: 64}\ncapture: {out_dir: s}\n"
        "head: {type: eagle3}\ntrain: {out_dir: o, lr: 1e-4}\n"
    )
    config = load_config(path)
    assert config["train"]["lr"] == "1e-4"  # YAML 1.1
    resolved = resolve(config, TrainConfig)
    assert resolved["train"]["lr"] == 1e-4 and resolved["capture"]["shard_samples"] == 256
    assert resolved["head"] == {"type": "eagle3", **HEAD_TYPES["eagle3"].head.options_model.defaults()}
    assert "lora" not in resolved and "regenerate" not in resolved


def unloadable_config(tmp_path, name, overrides):
    """configs/<name> with the target moved to a folder that does not exist: loading it would fail."""
    config = load_config(REPO / "configs" / name, [f"target.path={tmp_path / 'no-such-model'}", *overrides])
    return write_config(tmp_path / "config.yaml", config)


CAPTURE_PROBLEMS = [
    (
        ["data.limt=2"],
        r"unknown key data\.limt \(known: format, image_dir, limit, max_length, on_error, over_length, source\)",
    ),
    (["capture.shard_samples=-1"], r"capture\.shard_samples must be >= 1, got -1"),
    (["data.limit=0"], r"data\.limit must be >= 1, got 0"),
    (["data.limit=-1"], r"data\.limit must be >= 1, got -1"),
    (["capture.batch_tokens=0"], r"capture\.batch_tokens must be >= 1, got 0"),
    (["data.max_length=0"], r"data\.max_length must be >= 1, got 0"),
    (["capture.store_dtype=int8"], r"capture\.store_dtype must be one of 'fp32', .* or 'fp8_e4m3', got 'int8'"),
    (["regenerate.max_new_tokens=0"], r"regenerate\.max_new_tokens must be >= 1, got 0"),  # its package's too
]


@pytest.mark.parametrize("overrides, message", CAPTURE_PROBLEMS, ids=lambda v: v[0] if isinstance(v, list) else "")
def test_capture_refuses_a_bad_config_before_loading_the_target(tmp_path, overrides, message):
    out = tmp_path / "shards"
    path = unloadable_config(tmp_path, "demo-eagle3.yaml", [f"capture.out_dir={out}", *overrides])
    with pytest.raises(ConfigError, match=message):
        capture.main(["--config", str(path)])
    assert not out.exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lrr=1e-3"], r"unknown key train\.lrr"),  # another stage's section, in the same file
        (["head.ttt_stepz=3"], r"unknown key head\.ttt_stepz for a eagle3 head"),
    ],
)
def test_headstart_capture_checks_the_later_stages_sections_too(tmp_path, overrides, message, capsys):
    out = tmp_path / "shards"
    path = unloadable_config(tmp_path, "demo-eagle3.yaml", [f"capture.out_dir={out}", *overrides])
    with pytest.raises(SystemExit):
        cli.main(["capture", "--config", str(path)])
    assert re.search(message, capsys.readouterr().err) and not out.exists()


def test_a_valid_capture_config_gets_as_far_as_loading_the_target(tmp_path):
    # The control for the test above: without the bad key, the run goes on and fails at the missing target.
    path = unloadable_config(tmp_path, "demo-eagle3.yaml", [f"capture.out_dir={tmp_path / 'shards'}"])
    with pytest.raises(OSError, match="no-such-model"):
        capture.main(["--config", str(path)])


def test_capture_without_shard_settings_uses_the_defaults(tiny_target_dir, gsm8k_file, tmp_path):
    config = {
        "target": {"path": str(tiny_target_dir), "device": "cpu"},
        "data": {"source": str(gsm8k_file), "format": "gsm8k", "max_length": 64, "limit": 3},
        "capture": {"out_dir": str(tmp_path / "shards"), "aux_layers": [1, 3, 4]},
    }
    manifest = read_manifest(capture.run_capture(config))
    assert (manifest["samples"], manifest["shard_samples"], manifest["batch_tokens"]) == (3, 256, 8192)
    assert manifest["store_dtype"] == "bfloat16" and len(manifest["shards"]) == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["regenerate.temprature=0.7"],
            r"unknown key regenerate\.temprature \(known: base_url, chunk_size, concurrency, discard_stale_parts",
        ),
        (["regenerate.max_new_tokens=0"], r"regenerate\.max_new_tokens must be >= 1, got 0"),
        (["regenerate.temperature=-1"], r"regenerate\.temperature must be >= 0, got -1"),
        (["regenerate.top_p=0"], r"regenerate\.top_p must be > 0, got 0"),
        (["regenerate.chunk_size=0"], r"regenerate\.chunk_size must be >= 1, got 0"),
        (["regenerate.engine=openai"], r"regenerate\.base_url is required when engine is 'openai'"),
        (["regenerate.base_url=http://localhost:8000/v1"], r"regenerate\.base_url is only read by engine 'openai'"),
        (["regenerate.engine=vllm"], r"regenerate\.engine must be one of 'hf' or 'openai', got 'vllm'"),
        (["data.limit=0"], r"data\.limit must be >= 1, got 0"),
    ],
)
def test_regenerate_refuses_a_bad_config_before_loading_the_target(tmp_path, gsm8k_file, overrides, message):
    out = tmp_path / "regen.jsonl"
    path = unloadable_config(tmp_path, "demo-regenerate.yaml", [f"data.source={gsm8k_file}", f"regenerate.out={out}"])
    with pytest.raises(ConfigError, match=message):
        regenerate.main(["--config", str(path), *overrides])
    regenerate_parts = out.with_name(out.name + ".parts")
    assert not out.exists() and not regenerate_parts.exists()
    with pytest.raises(OSError, match="no-such-model"):  # the control: valid, it goes on to load the target
        regenerate.main(["--config", str(path)])


@pytest.mark.parametrize(
    "trainer, name, overrides, message",
    [
        (eagle, "demo-eagle3.yaml", ["train.max_steps=0"], r"train\.max_steps must be >= 1, got 0"),
        (eagle, "demo-eagle3.yaml", ["head.ttt_decay=-0.5"], r"head\.ttt_decay must be > 0, got -0\.5"),
        (eagle, "demo-eagle3.yaml", ["train.lr=0"], r"train\.lr must be > 0, got 0"),
        (eagle, "demo-eagle3.yaml", ["train.batch_size=0"], r"train\.batch_size must be >= 1, got 0"),
        (eagle, "demo-eagle3.yaml", ["head.ttt_steps=0"], r"head\.ttt_steps must be >= 1, got 0"),
        (eagle, "demo-eagle3.yaml", ["head.draft_vocab_size=0"], r"head\.draft_vocab_size must be >= 1, got 0"),
        (eagle, "demo-eagle3.yaml", ["train.micro_batch_size=0"], r"train\.micro_batch_size must be >= 1, got 0"),
        (eagle, "demo-eagle3.yaml", ["regenerate.out=x"], r"regenerate\.max_new_tokens is required"),
        (eagle, "demo-eagle.yaml", ["head.ploss_weight=-1"], r"head\.ploss_weight must be >= 0, got -1"),
        (medusa, "demo-medusa.yaml", ["head.decay=0"], r"head\.decay must be > 0, got 0"),
        (medusa, "demo-medusa.yaml", ["head.num_heads=0"], r"head\.num_heads must be >= 1, got 0"),
        (medusa, "demo-medusa.yaml", ["lora.r=0", "train.online_capture=true"], r"lora\.r must be >= 1, got 0"),
    ],
)
def test_training_refuses_out_of_range_values_before_any_work(tmp_path, monkeypatch, trainer, name, overrides, message):
    def no_work(*args, **kwargs):
        raise AssertionError("a bad config got as far as the process group")

    monkeypatch.setattr(trainer, "start_processes", no_work)
    path = unloadable_config(tmp_path, name, [f"train.out_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match=message):
        trainer.main(["--config", str(path), *overrides])
    assert not (tmp_path / "out").exists()


def test_demo_refuses_unknown_keys_before_running_a_stage(tmp_path):
    ran = tmp_path / "ran.txt"
    stage = {"name": "only", "cmd": f"{{python}} -c \"open(r'{ran}', 'w')\"", "ouputs": [str(ran)]}
    config = {"out_dir": str(tmp_path / "run"), "report": str(tmp_path / "r.md"), "nproc": 2, "stages": [stage]}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as err:
        demo.main(["--config", str(path)])
    assert str(err.value).splitlines()[1:] == [
        "  unknown key stages[0].ouputs (known: cmd, inputs, name, outputs)",
        "  unknown key 'nproc' (known: heads, nproc_per_node, out_dir, report, stages, target)",
    ]
    assert not ran.exists()


def test_build_demo_models_refuses_a_typo_before_reading_its_data(tmp_path):
    overrides = ["target.train.stepz=10", f"train_file={tmp_path / 'missing.jsonl'}", f"work_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"unknown key target\.train\.stepz \(known: batch_size, ckpt_every"):
        build_demo_models.main(["--config", str(REPO / "configs" / "build-demo-models.yaml"), *overrides])


# The names the library gives a config and its sections, and the models whose fields they hold.
SECTION_VARIABLES = {
    "train": [Train],
    "train_cfg": [Train],
    "cap": [Capture],
    "capture": [Capture],
    "regen": [Regenerate],
    "generation": [Generation],
    "data": [Data],
    "target": [Target],
    "head": list(HEAD_OPTIONS.values()),
    "head_cfg": list(HEAD_OPTIONS.values()),
    "options": list(HEAD_OPTIONS.values()),
    "lora": [Lora],
    "wandb": [Wandb],
    "metrics": [Metrics],
    "hp": [ModelTraining],
    "arch": [DemoModel],
}
SECTION_FIELDS = {
    name: {f for model in models for f in model.model_fields} for name, models in SECTION_VARIABLES.items()
}


def string_key_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Every ``x["key"]`` and ``x.get("key")`` that reads a config section by string key: any key of a config
    (``cfg``/``config``), a section of one (``x["train"]["lr"]``), or a section's field (``train["lr"]``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant):
            base, key = node.value, node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if not (node.args and isinstance(node.args[0], ast.Constant)):
                continue
            base, key = node.func.value, node.args[0].value
        else:
            continue
        name = base.id if isinstance(base, ast.Name) else None
        nested = isinstance(base, ast.Subscript) and isinstance(base.slice, ast.Constant) and base.slice.value
        if (
            name in ("cfg", "config")
            and key in SECTIONS
            or name == "cfg"
            or nested in SECTION_FIELDS
            and key in SECTION_FIELDS[nested]
            or name in SECTION_FIELDS
            and key in SECTION_FIELDS[name]
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_library_reads_its_settings_as_attributes_that_mypy_checks():
    reads = [
        f"{path.relative_to(REPO)}:{line}: {code}"
        for top in ("core", "heads", "data_recipes", "decoding", "train", "eval", "scripts")
        for path in sorted((REPO / top).rglob("*.py"))
        for line, code in string_key_reads(ast.parse(path.read_text()))
    ]
    assert not reads, "config sections read by string key (read the validated model's attributes):\n" + "\n".join(reads)
    # The check finds what it looks for: the reads this replaced.
    old = 'def f(cfg, train):\n  cfg["train"]["lr"]\n  train["seed"]\n  cfg.get("lora")\n  x["capture"]["out_dir"]'
    assert sorted(line for line, _ in string_key_reads(ast.parse(old + '\n  train["x"] = 1'))) == [2, 2, 3, 4, 5]


def test_a_tree_file_is_looked_for_when_eval_runs_not_when_the_pipeline_file_is_checked(tmp_path):
    later = str(tmp_path / "autotune" / "tree.json")  # autotune writes it after training
    settings = {"target": "t", "method": ["eagle3"], "head": ["h"], "bench": "b", "out": "o", "tree": later}
    assert parse({"eval": settings}, PipelineConfig).eval.tree_file() == Path(later)
    with pytest.raises(FileNotFoundError, match=f"--tree {later}: expected static, dynamic or a tree.json file"):
        acceptance.run(parse({"eval": settings | {"method": ["vanilla"], "head": []}}, PipelineConfig).eval)


@pytest.mark.parametrize("kernel", ["", "flashy", "SDPA"])
def test_a_target_attention_kernel_transformers_does_not_know_is_refused_with_the_config(kernel):
    """Checked with the config, not when the target loads after the run has started writing."""
    config = load_config(REPO / "configs" / "demo-eagle3.yaml", [f"target.attn_implementation={kernel}"])
    with pytest.raises(ConfigError, match=f"target.attn_implementation must be auto, eager, .*got '{kernel}'"):
        resolve_config(config, "eagle")
