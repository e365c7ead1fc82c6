"""The demo's stage runner: a finished stage is skipped; a changed input, or an upstream stage that ran, re-runs it; a
failure says so.

The stages here are small shell-free Python one-liners that append to a log, so the tests see exactly
which commands ran. The real pipeline under SIGKILL is tests/scripts/test_fault_injection.py.
"""

import json

import pytest
import yaml

from headstart.core.config_files import ConfigError, load_config
from headstart.core.settings import parse
from headstart.scripts.demo import DemoConfig, main, run_stages, summary
from tests.helpers import REPO

# Writes its name to the file argv[2] and appends it to the log argv[3].
WRITE = (
    "import sys, pathlib; pathlib.Path(sys.argv[2]).write_text(sys.argv[1]); "
    "open(sys.argv[3], 'a').write(sys.argv[1] + ' ')"
)


def pipeline(tmp_path, fail: str = "") -> dict:
    """``first`` (input: input.txt) writes a.txt, then ``second`` writes b.txt; ``fail`` names one that exits 3."""

    def stage(name: str, out: str, inputs: list[str]) -> dict:
        write = f'{{python}} -c "{WRITE}" {name} {tmp_path / out} {tmp_path / "ran.log"}'
        cmd = '{python} -c "raise SystemExit(3)"' if name == fail else write
        return {"name": name, "cmd": cmd, "inputs": inputs, "outputs": [str(tmp_path / out)]}

    (tmp_path / "input.txt").write_text("v1")
    return {
        "out_dir": str(tmp_path / "run"),
        "report": str(tmp_path / "run" / "report.md"),
        "stages": [stage("first", "a.txt", [str(tmp_path / "input.txt")]), stage("second", "b.txt", [])],
    }


def run(cfg: dict, only: set[str] | None = None) -> dict:
    """The stages of ``cfg`` as the demo runs them, its config checked first."""
    return run_stages(parse(cfg, DemoConfig), only)


def ran(tmp_path) -> list[str]:
    log = tmp_path / "ran.log"
    runs = log.read_text().split() if log.exists() else []
    log.unlink(missing_ok=True)
    return runs


def test_finished_stages_are_skipped_and_changes_rerun_what_they_affect(tmp_path, capsys):
    cfg = pipeline(tmp_path)
    timings = run(cfg)
    assert ran(tmp_path) == ["first", "second"]
    assert [t["status"] for t in timings["stages"].values()] == ["ran", "ran"]
    assert json.loads((tmp_path / "run" / "timings.json").read_text())["stages"].keys() == {"first", "second"}

    timings = run(cfg)
    assert ran(tmp_path) == []
    assert capsys.readouterr().out.count("done, skipped (outputs complete") == 2
    assert all(t["seconds"] == 0 and t["seconds_when_run"] > 0 for t in timings["stages"].values())

    (tmp_path / "b.txt").unlink()  # a missing output: that stage again, not its upstream
    run(cfg)
    assert ran(tmp_path) == ["second"]

    (tmp_path / "a.txt").unlink()  # a stage that runs again: everything made from its outputs too
    run(cfg, only={"first"})
    assert ran(tmp_path) == ["first"]
    run(cfg)  # a later invocation still knows: the stale stage's stamp went when its upstream ran
    assert ran(tmp_path) == ["second"]

    (tmp_path / "input.txt").write_text("v2")  # a changed input: its stage and everything after it
    run(cfg)
    assert ran(tmp_path) == ["first", "second"]

    cfg["stages"][0]["cmd"] += " extra"  # a changed command, likewise
    run(cfg)
    assert ran(tmp_path) == ["first", "second"]


def test_a_subset_of_stages_keys_them_as_the_full_run_does(tmp_path):
    cfg = pipeline(tmp_path)
    run(cfg, only={"first"})
    assert ran(tmp_path) == ["first"]
    run(cfg)
    assert ran(tmp_path) == ["second"]


def test_stage_paths_take_config_keys_as_commands_do(tmp_path):
    """``{heads}`` in outputs is the folder the config names: published heads elsewhere are not this run's output."""
    cfg = pipeline(tmp_path)
    cfg["heads"] = str(tmp_path / "mine")
    (tmp_path / "mine").mkdir()
    cfg["stages"][1]["cmd"] = cfg["stages"][1]["cmd"].replace(str(tmp_path / "b.txt"), "{heads}/b.txt")
    cfg["stages"][1]["outputs"] = ["{heads}/b.txt"]
    run(cfg)
    assert ran(tmp_path) == ["first", "second"] and (tmp_path / "mine" / "b.txt").read_text() == "second"
    run(cfg)
    assert ran(tmp_path) == []
    (tmp_path / "mine" / "b.txt").unlink()
    run(cfg)
    assert ran(tmp_path) == ["second"]
    cfg["stages"][1]["inputs"] = ["{nowhere}/x"]
    with pytest.raises(ConfigError, match=r"stage second: \{nowhere\} in its inputs is not a config key"):
        run(cfg)


def test_the_summary_shows_the_training_plots_of_the_heads_its_stages_write(tmp_path):
    """Another run in the same output folder (an experiment beside the demo's heads) is not the demo's."""
    cfg = pipeline(tmp_path)
    cfg["stages"][1]["outputs"] = [str(tmp_path / "run" / "mine" / "head" / "model.safetensors")]
    for run_dir in ("mine", "experiment"):
        (tmp_path / "run" / run_dir).mkdir(parents=True)
        (tmp_path / "run" / run_dir / "acceptance.png").write_bytes(b"png")
    text = summary(parse(cfg, DemoConfig), {"stages": {}, "total_s": 0.0, "all_stages_when_run_s": 0.0})
    plots = [line for line in text.splitlines() if line.startswith("training acceptance:")]
    assert plots == [f"training acceptance: {tmp_path / 'run' / 'mine' / 'acceptance.png'}"]


def test_a_failed_stage_stops_the_run_and_says_how_to_resume(tmp_path):
    cfg = pipeline(tmp_path, fail="second")
    with pytest.raises(SystemExit, match=r"\[2/2\] stage second: failed \(exit code 3\).*Run the demo again to resume"):
        run(cfg)
    assert ran(tmp_path) == ["first"]
    assert not (tmp_path / "run" / "stages" / "second.json").exists()


def test_cli_rejects_unknown_stages_and_placeholders(tmp_path):
    cfg = pipeline(tmp_path)
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"no stage named \['nope'\]"):
        main(["--config", str(path), "--stages", "first,nope"])
    cfg["stages"][0]["cmd"] = "{python} {unknown_key}"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"stage first: \{unknown_key\} in its cmd is not a config key"):
        main(["--config", str(path)])


def test_the_bundled_demo_config_chains_every_stage_the_issue_asks_for():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    names = [s["name"] for s in cfg["stages"]]
    assert names == [
        "regenerate",
        "capture",
        "train-eagle3",
        "train-medusa",
        "train-dflash",
        "train-dflash2",
        "eval",
        "export-vllm",
        "export-speculators",
        "export-dflash",
        "export-dflash2",
    ]
    eval_cmd = next(s["cmd"] for s in cfg["stages"] if s["name"] == "eval")
    for method in ("vanilla", "ngram", "draft_model", "eagle3", "medusa", "dflash", "dflash2"):
        assert method in eval_cmd
    assert "--out runs/demo" in eval_cmd and cfg["report"] == "runs/demo/report.md"


@pytest.mark.parametrize("name", ["../../victim", "/tmp/victim", "a/b", ".hidden", ""])
def test_a_stage_name_that_is_not_a_plain_name_is_refused_with_the_config(tmp_path, name):
    """A stage's name is its stamp's file name: ``../../victim`` would write, then delete, a file outside out_dir."""
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    cfg = pipeline(tmp_path)
    cfg["out_dir"] = str(tmp_path / "a" / "b")
    cfg["stages"][1]["name"] = name
    with pytest.raises(ConfigError, match=r"stages\[1\]\.name: .* is not a plain name"):
        run(cfg)
    assert victim.read_text() == "keep" and ran(tmp_path) == []


def test_two_stages_of_one_name_are_refused(tmp_path):
    cfg = pipeline(tmp_path)
    cfg["stages"][1]["name"] = "first"
    with pytest.raises(ConfigError, match=r"stage names \['first'\] are given more than once"):
        run(cfg)


def test_an_output_changed_in_place_reruns_the_stages_after_it_once(tmp_path, capsys):
    """A head retrained in its stage's folder: the evaluation and export made from the old one run again."""
    cfg = pipeline(tmp_path)
    run(cfg)
    assert ran(tmp_path) == ["first", "second"]
    (tmp_path / "a.txt").write_text("first, retrained with more steps")
    capsys.readouterr()
    run(cfg)
    assert ran(tmp_path) == ["second"]
    out = capsys.readouterr().out
    assert f"stage first: done, skipped (outputs complete: {tmp_path / 'a.txt'}; the same command" in out
    assert f"{tmp_path / 'a.txt'} changed since then: the stages after it run again" in out
    run(cfg)
    assert ran(tmp_path) == []
    assert "changed since then" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "damage",
    [b"", b"[]", b'"seconds"', b'{"key": "K", "seconds": "12"}', b'{"key": "K"}', b"\xff\xfe{", b'{"seconds": 1}'],
)
def test_a_damaged_stamp_counts_as_none_and_is_named(tmp_path, capsys, damage):
    cfg = pipeline(tmp_path)
    run(cfg)
    assert ran(tmp_path) == ["first", "second"]
    stamp = tmp_path / "run" / "stages" / "second.json"
    key = json.loads(stamp.read_text())["key"]
    stamp.write_bytes(damage.replace(b'"K"', json.dumps(key).encode()))
    capsys.readouterr()
    run(cfg)
    assert ran(tmp_path) == ["second"]
    assert f"stage second: its stamp {stamp} is damaged (" in capsys.readouterr().out
    run(cfg)
    assert ran(tmp_path) == []
