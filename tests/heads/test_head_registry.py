"""The head registry: a head type is one entry (``heads.HeadType``), and everything finds head types through it.

A head type defined here, outside the package (its options, module, proposer and engine layout), is registered
with one call per floor (the head type, its proposer, its layouts) and then trained, evaluated, autotuned, exported
and imported back by headstart's own commands, with no edit to headstart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from headstart.core.config_files import ConfigError
from headstart.decoding.head_proposers import PROPOSERS, register_proposer
from headstart.decoding.proposers_eagle import Eagle
from headstart.eval import acceptance, autotune
from headstart.export.common import arch_from_decoder, decoder_config, read_checkpoint, read_json
from headstart.export.layouts import EngineFiles, Imported, not_written
from headstart.export.registry import HEAD_LAYOUTS, register_layouts
from headstart.heads import (
    HEAD_TYPES,
    WEIGHTS_NAME,
    Drafting,
    HeadConfig,
    HeadType,
    drafting_of,
    read_head_config,
    register,
    registered,
)
from headstart.heads.eagle import EagleHead, EagleOptions
from headstart.scripts.export import command as export
from headstart.scripts.export import import_head
from headstart.train import eagle
from tests.helpers import REPO, run_here

pytestmark = pytest.mark.usefixtures("one_thread")


class LoopOptions(EagleOptions):
    type: Literal["loop"] = "loop"  # type: ignore[assignment]


class LoopHead(EagleHead):
    """EAGLE-1's layer under another name: what matters here is that headstart knows nothing of it."""

    head_type = "loop"
    options_model = LoopOptions


class LoopDrafter(Eagle):
    title = "Loop"


class PlainLayout:
    """An engine layout of its own: our tensors as they are, the draft layer's shape in config.json."""

    LAYOUTS = ("plain",)
    SOURCES = ("plain",)
    FILES = (WEIGHTS_NAME,)
    SERVED = False

    def refusal(self, fmt: str) -> str:
        return not_written("loop", fmt, self.LAYOUTS)

    def export_files(
        self, config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
    ) -> EngineFiles:
        return EngineFiles({"architectures": ["PlainLoop"], **decoder_config(config.arch, "float32")}, dict(state))

    def extra_files(self, config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
        return {}

    def import_files(self, kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
        engine_config, state = read_json(src / "config.json"), read_checkpoint(src)
        return Imported({"type": "loop"}, arch_from_decoder(engine_config, target_config), state)

    def layout(self, fmt: str, short: bool = False) -> str:
        return "the plain layout"

    def describe(self, config: HeadConfig) -> list[tuple[str, str]]:
        return [("feature", "the target's last hidden state")]

    def serve(self, config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
        return "No engine serves it."


LOOP = HeadType(
    name="loop",
    head=LoopHead,
    trainer="eagle",
    fuses_layers=False,
    drafting=Drafting("loop", "Loop"),
)
PLAIN = PlainLayout()


@pytest.fixture
def loop_head_type():
    with registered(LOOP):
        register_proposer("loop", LoopDrafter)  # decoding's table: the proposer that drafts the loop method
        register_layouts("loop", PLAIN)  # export's table: the layouts of loop heads
        try:
            yield LOOP
        finally:
            del PROPOSERS["loop"], HEAD_LAYOUTS["loop"]


def test_a_head_type_from_outside_trains_evaluates_autotunes_and_exports(
    loop_head_type, make_config, sharp_target_dir, gsm8k_file, tmp_path, monkeypatch
):
    config, out_dir = make_config("eagle", "loop")
    run_here(monkeypatch, eagle, config, "head={type: loop}")  # train/eagle.py: the entry's trainer
    head_dir = out_dir / "head"
    saved = read_head_config(head_dir)
    assert saved.type == "loop" and isinstance(saved.options, LoopOptions) and drafting_of(saved).title == "Loop"

    argv = ["--target", str(sharp_target_dir), "--head", str(head_dir), "--bench", str(gsm8k_file)]
    report = acceptance.main(argv + ["--method", "vanilla,loop", "--limit", "1", "--max-new-tokens", "8",
                                     "--tree", "static", "--depth", "3", "--out", str(tmp_path / "eval")])  # fmt: skip
    assert report["methods"]["loop"]["greedy_identical"] is True  # drafted by its own proposer, verified by ours

    tuned = autotune.main(argv + ["--calibration", "1", "--heldout", "1", "--max-new-tokens", "6", "--max-nodes", "4",
                                  "--max-depth", "2", "--comb-width", "2", "--repeats", "1", "--batch-sizes", "1",
                                  "--out", str(tmp_path / "tune"), "--write-head"])  # fmt: skip
    assert all(row["greedy_identical"] for row in tuned["grid"])
    tree = json.loads((head_dir / "tree.json").read_text())
    assert tree["method"] == "loop" and tuned["adaptive"]["level_by_level"]  # Eagle drafts level by level

    exported = tmp_path / "plain"  # its layout is a --format choice now, as its SOURCES are --from choices
    export.main(["--head", str(head_dir), "--format", "plain", "--out", str(exported)])
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["PlainLoop"]
    card = (exported / "README.md").read_text()
    assert (
        "# Loop draft head for" in card and "| format | the plain layout |" in card and "No engine serves it." in card
    )
    back = tmp_path / "imported"
    import_head.main(["--from", "plain", str(exported), "--out", str(back), "--target", str(sharp_target_dir)])
    ours, theirs = load_file(str(head_dir / WEIGHTS_NAME)), load_file(str(back / WEIGHTS_NAME))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_registered_head_types_config_section_is_checked_like_the_packages(loop_head_type, make_config):
    from headstart.train.train_config import parse_args

    config, _ = make_config("eagle", "typo")
    with pytest.raises(ConfigError, match=re.escape("unknown key head.fc_biass for a loop head")):
        parse_args("eagle", ["--config", str(config), "head={type: loop, fc_biass: true}"])
    assert parse_args("eagle", ["--config", str(config), "head={type: loop}"]).head == LoopOptions()


def test_unregistered_head_types_are_refused_by_name(make_config):
    from headstart.train.train_config import parse_args

    config, _ = make_config("eagle", "gone")
    assert "loop" not in HEAD_TYPES  # registered only for the tests that ask for it
    with pytest.raises(ConfigError, match=r"head\.type 'loop' is not a head type"):
        parse_args("eagle", ["--config", str(config), "head={type: loop}"])


def test_registering_a_built_in_again_for_a_block_leaves_it_registered():
    from headstart.heads import eagle as eagle_module

    with registered(eagle_module.HEAD_TYPE):
        assert HEAD_TYPES["eagle"] is eagle_module.HEAD_TYPE
    assert HEAD_TYPES["eagle"] is eagle_module.HEAD_TYPE


def test_an_entry_that_contradicts_its_module_or_takes_a_method_is_refused():
    with pytest.raises(ValueError, match="a head type 'eagle3' is registered already"):
        register(HeadType("eagle3", LoopHead, "eagle", False, Drafting("x", "X")))
    with pytest.raises(ValueError, match="its module and options must declare type 'other'"):
        register(HeadType("other", LoopHead, "eagle", False, Drafting("x", "X")))
    with pytest.raises(ValueError, match=r"drafting methods \['eagle3'\] are taken"):
        register(HeadType("loop", LoopHead, "eagle", False, Drafting("eagle3", "X")))
    with pytest.raises(ValueError, match="fuses target layers: its options need a layer_ids option"):
        register(HeadType("loop", LoopHead, "eagle", True, Drafting("x", "X")))
    assert "loop" not in HEAD_TYPES


LIBRARY = ("core", "heads", "data_recipes", "decoding", "train", "eval", "export", "scripts")
# The served-parity harness runs the real engines' own drafts, one kind at a time (its --eagle3/--peagle/... flags):
# what vLLM and speculators do per kind is engine knowledge, kept beside the layouts.
PARITY_HARNESS = {f"scripts/export/verify_engines{part}.py" for part in ("", "_side", "_judge")}


def source_file(module: str) -> str:
    """``headstart.heads.eagle`` -> ``heads/eagle.py``."""
    return module.removeprefix("headstart.").replace(".", "/") + ".py"


def branch_pattern() -> re.Pattern[str]:
    """A registered head type's name or drafting method compared, or its head or options class tested: every name
    read from the registry, so a head type is guarded the day it registers."""
    names = {entry.name for entry in HEAD_TYPES.values()} | {
        d.method for e in HEAD_TYPES.values() for d in e.draftings()
    }
    classes = {cls.__name__ for entry in HEAD_TYPES.values() for cls in (entry.head, entry.options)}
    quoted, tested = "|".join(map(re.escape, sorted(names))), "|".join(map(re.escape, sorted(classes)))
    return re.compile(rf"""(==|!=|\bin\b)\s*\(?["']({quoted})["']|isinstance\([^)]*\b({tested})\b""")


def own_modules() -> set[str]:
    """The heads' modules and their engine layouts' (and heads/target.py, the families served), which may branch."""
    heads = {source_file(entry.head.__module__) for entry in HEAD_TYPES.values()}
    layouts = {source_file(layouts.__name__) for layouts in HEAD_LAYOUTS.values()}
    return heads | layouts | {"heads/target.py"}


def test_nothing_outside_the_heads_and_their_layouts_branches_on_a_head_type():
    branch, allowed = branch_pattern(), own_modules() | PARITY_HARNESS
    assert {"heads/dspark.py", "heads/dflash2.py", "export/dspark.py", "export/dflash2.py"} <= allowed
    found = []
    for folder in LIBRARY:
        for path in sorted((REPO / folder).rglob("*.py")):
            where = str(path.relative_to(REPO))
            if where in allowed:
                continue
            found += [f"{where}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []
    # The check finds what it looks for, for every registered head type.
    assert branch.search('if config.type == "dflash":') and branch.search("isinstance(head, MedusaHead)")
    assert branch.search('if method in ("peagle", "x"):') and branch.search("isinstance(head, DSparkHead)")
    assert branch.search("isinstance(options, Dflash2Options)") and branch.search('kind != "dflash2"')
