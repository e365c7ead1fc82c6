"""The training config schema: bad configs fail before any work, with a message naming the problem."""

import pytest
import yaml

from headstart.core.config_files import ConfigError, load_config
from headstart.core.runtime import cosine_with_warmup
from headstart.heads.eagle3 import Eagle3Options
from headstart.train import eagle, medusa
from headstart.train.data import rank_micro_batches
from headstart.train.train_config import resolve_config
from tests.helpers import REPO

TRAINER_OF = {"eagle": "eagle", "eagle3": "eagle", "medusa": "medusa"}
TRAINED_CONFIGS = [
    "demo-eagle3",
    "demo-eagle",
    "demo-medusa",
    "llama-3.1-8b-instruct-eagle3",
    "qwen2.5-7b-instruct-eagle3",
    "qwen3-8b-eagle3",
    "qwen3-30b-a3b-eagle3",
    "gpt-oss-20b-eagle3",
]


@pytest.mark.parametrize("name", TRAINED_CONFIGS)
def test_bundled_configs_match_the_schema(name):
    config = load_config(REPO / "configs" / f"{name}.yaml")
    resolved = resolve_config(config, TRAINER_OF[config["head"]["type"]])
    assert resolved.train.out_dir.startswith("runs/")
    if name.endswith("eagle3") and not name.startswith("demo"):  # the real targets: documentation
        assert isinstance(resolved.head, Eagle3Options)
        assert resolved.head.draft_vocab_size == 32000 and resolved.train.dtype == "bf16"


@pytest.fixture
def demo_config(tmp_path):
    """The EAGLE-3 demo config with its outputs moved under tmp_path (it must never get that far)."""
    config = load_config(REPO / "configs" / "demo-eagle3.yaml")
    config["train"]["out_dir"] = str(tmp_path / "out")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / "out"


@pytest.mark.parametrize(
    "trainer, overrides, message",
    [
        (eagle, ["train.lrr=1e-3"], r"unknown key train\.lrr \(known: .*lr"),
        (eagle, ["trian.lr=1e-3"], r"unknown section 'trian'"),
        (eagle, ["head.ttt_stepz=3"], r"unknown key head\.ttt_stepz for a eagle3 head"),
        (eagle, ["train.batch_size=many"], r"train\.batch_size must be int, got 'many' \(str\)"),
        (eagle, ["train.lr=fast"], r"train\.lr must be float, got 'fast'"),
        (eagle, ["train.online_capture=3"], r"train\.online_capture must be bool or 'vllm', got 3"),
        (eagle, ["train.zero_stage=4"], r"train\.zero_stage must be one of 0, 1, 2 or 3, got 4"),
        (eagle, ["head.type=medusa"], r"head\.type 'medusa' is trained by train/medusa\.py, not train/eagle\.py"),
        (medusa, [], r"head\.type 'eagle3' is trained by train/eagle\.py, not train/medusa\.py"),
        (eagle, ["head.type=hydra"], r"head\.type 'hydra' is not a head type"),
        (eagle, ["train.batch_size=7"], r"train\.batch_size \(7\) must be a multiple of train\.micro_batch_size"),
        (eagle, ["lora.r=8"], r"Medusa-2 .* set train\.online_capture: true"),
        (eagle, ["lora.r=8", "train.online_capture=true", "target.tp_size=2"], r"cannot train a split target"),
        (
            eagle,
            ["head={type: dflash, block_size: 5000}"],
            r"head\.block_size \(5000\) must not exceed data\.max_length \(512\)",
        ),
    ],
)
def test_config_errors_fail_before_any_work(demo_config, trainer, overrides, message, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("a bad config got as far as the process group")

    monkeypatch.setattr(trainer, "start_processes", no_work)
    path, out_dir = demo_config
    with pytest.raises(ConfigError, match=message):
        trainer.main(["--config", str(path), *overrides])
    assert not out_dir.exists()


def test_every_problem_is_reported_at_once(demo_config):
    path, _ = demo_config
    with pytest.raises(ConfigError) as err:
        eagle.main(["--config", str(path), "train.lrr=1", "train.epochs=two", "data.formatt=x"])
    assert all(key in str(err.value) for key in ("train.lrr", "train.epochs", "data.formatt"))


def test_defaults_fill_in_and_yaml_exponents_read_as_floats():
    config = {
        "target": {"path": "t"},
        "data": {"source": "d.jsonl", "format": "gsm8k", "max_length": 64},
        "capture": {"out_dir": "shards"},
        "head": {"type": "eagle"},
        "train": {"out_dir": "runs/x", "lr": "1e-3"},  # YAML 1.1 reads 1e-3 (no dot) as a string
    }
    resolved = resolve_config(config, "eagle")
    assert resolved.train.lr == 1e-3 and resolved.train.zero_stage == 2
    assert resolved.wandb.mode == "disabled" and resolved.lora is None


def test_micro_batches_do_not_depend_on_the_number_of_processes():
    order = list(range(100, 116))
    one = rank_micro_batches(order, 1, batch_size=8, micro_batch_size=2, rank=0, world=1)
    two = [rank_micro_batches(order, 1, 8, 2, rank, 2) for rank in (0, 1)]
    assert one == [[108, 109], [110, 111], [112, 113], [114, 115]]
    assert two == [[one[0], one[2]], [one[1], one[3]]]  # micro-step m on rank r takes chunk m * world + r


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    lrs = [cosine_with_warmup(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[20] == pytest.approx(0.1)
