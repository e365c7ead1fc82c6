"""eval as a library: one acceptance model, one timer, typed builders, and no library code importing a CLI."""

import ast
import time

import pytest
import torch

from headstart.core.acceptance import chain_tau, expected_tau
from headstart.core.timing import timed
from headstart.decoding.methods import TreeSettings, build_proposer
from headstart.decoding.proposers import DraftModel, NGram, Vanilla
from headstart.decoding.proposers_eagle import Eagle, PEagle
from headstart.decoding.proposers_medusa import Medusa
from headstart.decoding.tree_config import TreeSpec, chain_choices
from headstart.eval.speedup import predicted_speedup
from headstart.heads import build_head
from headstart.train.metrics import predicted_tau
from tests.helpers import REPO, tiny_llama

CLIS = {"eval.acceptance", "eval.autotune"}


def _modules(folder: str) -> dict[str, ast.Module]:
    return {f"{folder}.{p.stem}": ast.parse(p.read_text()) for p in sorted((REPO / folder).glob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """Modules imported, and ``module.name`` for every name imported from one; ours without ``headstart.``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name.removeprefix("headstart.") for name in names}


def test_no_eval_module_imports_a_cli_or_a_private_name_and_eval_and_train_stay_apart():
    evals, trains = _modules("eval") | _modules("decoding"), _modules("train")
    for name, tree in evals.items():
        imports = _imports(tree)
        assert not imports & CLIS, f"{name} imports a CLI module: {imports & CLIS}"
        private = [i for i in imports if i.split(".")[0] in ("core", "eval", "decoding", "heads") and "._" in i]
        assert not private, f"{name} imports private names {private}"
        if name not in CLIS:
            assert "argparse" not in imports, f"{name} is library code but parses arguments"
        assert not any(i == "train" or i.startswith("train.") for i in imports), f"{name} imports train"
    for name, tree in trains.items():
        assert not any(i == "eval" or i.startswith("eval.") for i in _imports(tree)), f"{name} imports eval"


def test_every_public_eval_function_has_type_hints():
    missing = []
    for name, tree in (_modules("eval") | _modules("decoding")).items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or (node.name.startswith("_") and node.name != "__init__"):
                continue
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            unhinted = [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]
            if node.returns is None or unhinted:
                missing.append(f"{name}:{node.lineno} {node.name} {unhinted}")
    assert missing == []


@pytest.mark.parametrize("rates", [[], [0.8], [0.7, 0.75, 0.78], [1.0, 1.0, 1.0], [0.0, 0.9]])
def test_training_eval_and_the_tuner_share_one_acceptance_model(rates):
    tau = 1.0
    for depth in range(1, len(rates) + 1):  # 1 + a_1 + a_1 a_2 + ..., written out
        tau += torch.tensor(rates[:depth], dtype=torch.float64).prod().item()
    assert chain_tau(rates) == pytest.approx(tau, rel=1e-12)
    assert predicted_tau is chain_tau  # training's prediction from held-out top-1 accuracies
    assert expected_tau([[a, 0.5] for a in rates], chain_choices(len(rates))) == chain_tau(rates)  # tree model
    if len(set(rates)) <= 1:  # the report's chain speedup model at c = 0 is the same tau
        alpha = rates[0] if rates else 0.3
        assert predicted_speedup(alpha, 0.0, len(rates)) == chain_tau([alpha] * len(rates))


def test_the_timer_returns_the_result_and_the_seconds_taken():
    result, seconds = timed(torch.device("cpu"), lambda x: time.sleep(x) or x + 1, 0.05)
    assert result == 1.05 and 0.05 <= seconds < 1.0


def test_build_proposer_takes_typed_settings():
    target = tiny_llama(num_hidden_layers=4)
    heads = {
        "eagle3": build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, target),
        "medusa": build_head({"type": "medusa", "num_heads": 2}, target),
    }
    assert type(build_proposer("vanilla", TreeSettings().tree_spec())) is Vanilla
    ngram = build_proposer("ngram", TreeSettings(depth=3).tree_spec())
    assert isinstance(ngram, NGram) and ngram.k == 3
    draft = build_proposer(
        "draft_model", TreeSettings(tree="dynamic", top_k_draft=2, depth=3, total_tokens=5).tree_spec(), target
    )
    assert isinstance(draft, DraftModel) and (draft.k, draft.top_k, draft.total_tokens) == (3, 2, 5)
    chain = build_proposer("eagle3", TreeSettings(tree="static", depth=4).tree_spec(), heads=heads)
    assert isinstance(chain, Eagle) and (chain.top_k, chain.depth, chain.total_tokens) == (1, 4, 4)
    flags = TreeSettings().tree_spec()
    tuned = TreeSpec.from_config({"shape": "static", "choices": [[0], [1], [0, 0]], "depth": 2, "top_k": 2,
                                  "total_tokens": 3})  # fmt: skip
    assert build_proposer("eagle3", flags, heads=heads, tuned=tuned).choices == tuned.choices
    medusa = build_proposer("medusa", TreeSettings(depth=5, total_tokens=6).tree_spec(), heads=heads)
    assert isinstance(medusa, Medusa) and medusa.depth == 2 and len(medusa.choices) == 6  # 2 heads: depth 2
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        build_proposer("beam", TreeSettings().tree_spec())
    heads["peagle"] = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "parallel_drafting": True}, target)
    peagle = build_proposer(
        "peagle", TreeSettings(tree="dynamic", depth=4).tree_spec(), heads=heads
    )  # one forward: a chain
    assert isinstance(peagle, PEagle) and peagle.choices == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    assert build_proposer("peagle", flags, heads=heads, tuned=tuned).choices == tuned.choices
    with pytest.raises(ValueError, match="P-EAGLE drafts static shapes only"):
        build_proposer("peagle", flags, heads=heads, tuned=TreeSpec.dynamic(3, 2, 5))


def test_methods_take_turns_and_each_output_is_independent_of_the_others(demo_target, one_thread):
    """run_methods interleaves the methods item by item; seeding each (item, method) decode from the item's
    index keeps a sampled method's tokens the same whether it runs alone or beside others."""
    from headstart.data_recipes.bench import BenchItem
    from headstart.decoding.verify import Sampling
    from headstart.eval.run import run_methods

    model, tokenizer = demo_target
    items = [BenchItem(id=str(i), category="math", turns=[f"What is {i} plus {i + 2}?"]) for i in range(3)]
    sampling = Sampling(temperature=1.0)
    alone = run_methods(model, tokenizer, {"vanilla": Vanilla()}, items, 12, sampling, seed=5)
    beside = run_methods(model, tokenizer, {"vanilla": Vanilla(), "ngram": NGram(k=3)}, items, 12, sampling, seed=5)
    assert beside["vanilla"].outputs == alone["vanilla"].outputs
    assert beside["vanilla"].ids == beside["ngram"].ids == ["0", "1", "2"]
    greedy = run_methods(model, tokenizer, {"vanilla": Vanilla(), "ngram": NGram(k=3)}, items, 12, Sampling(), seed=5)
    assert greedy["ngram"].outputs == greedy["vanilla"].outputs
    assert greedy["ngram"].new_tokens == greedy["vanilla"].new_tokens > 0
