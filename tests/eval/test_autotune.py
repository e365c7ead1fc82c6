"""Tree auto-tuning: the tuner finds the analytically optimal tree; acceptance statistics and tau bookkeeping; the
tree.json it writes, read through one schema wherever it is read (eval, the model card, a tree given in code)."""

import itertools
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from headstart.core.acceptance import expected_tau
from headstart.decoding.methods import TreeSettings, tuned_trees
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.tree_config import (
    TreeSpec,
    chain_choices,
    check_tree_vocab,
    comb_choices,
    load_tree_config,
    scheduled_depth,
)
from headstart.decoding.verify import Sampling
from headstart.eval import acceptance
from headstart.eval.speedup import Costs, RankCounts, best_shape, predict, tree_tau, tune
from headstart.export.card import served_schedule, tree_card_section, vllm_command
from headstart.heads import build_head, read_head_folder
from tests.helpers import make_head, tiny_llama

# Synthetic acceptance: p[depth][rank], falling with rank and (slowly) with depth.
RANK_PROBS = [[0.7, 0.12, 0.05], [0.75, 0.1, 0.04], [0.78, 0.08, 0.03], [0.8, 0.07, 0.02]]

# A valid dynamic and static tree.json: the schema tests change one key of either.
DYNAMIC = {"shape": "dynamic", "choices": None, "depth": 3, "top_k": 4, "total_tokens": 8}
STATIC = {"shape": "static", "choices": [[0], [1], [0, 0]], "depth": 2, "top_k": 2, "total_tokens": 3}


def costs(verify_slope: float, level_ms: float = 2.0, batch_slope: float = 0.0) -> Costs:
    """A synthetic CPU-like curve: verify = 17 ms + slope per node (+ a per-extra-sequence cost)."""
    nodes = list(range(0, 65, 4))
    verify = {b: [17 + verify_slope * n + batch_slope * (b - 1) * (n + 1) for n in nodes] for b in (1, 8)}
    return Costs(nodes, verify, [1, 8], [level_ms, level_ms], base_ms=1.5)


def all_trees(max_depth: int, width: int):
    """Every non-empty rank-path tree (parent-closed set) of depth <= max_depth and width <= width."""
    paths = [list(p) for d in range(1, max_depth + 1) for p in itertools.product(range(width), repeat=d)]
    for mask in range(1, 2 ** len(paths)):
        chosen = [p for i, p in enumerate(paths) if mask >> i & 1]
        present = {tuple(p) for p in chosen}
        if all(len(p) == 1 or tuple(p[:-1]) in present for p in chosen):
            yield chosen


@pytest.mark.parametrize("slope", [0.15, 0.6, 3.0])
def test_tuner_picks_the_analytically_optimal_tree(slope):
    # Brute force over every tree of depth <= 3 and width <= 2 (the tuner's search is bounded alike): the
    # tuner's pick has the highest expected tokens/s of all of them, vanilla included.
    probs = [p[:2] for p in RANK_PROBS[:3]]
    c = costs(slope)
    best, vanilla, _ = tune(c, probs, max_nodes=14, max_depth=3)
    brute = max((predict(c, probs, TreeSpec.static(t)) for t in all_trees(3, 2)), key=lambda t: t.tokens_per_s)
    assert best.tokens_per_s == pytest.approx(brute.tokens_per_s, rel=1e-12)
    assert best.tree.choices == brute.tree.choices
    assert vanilla.tokens_per_s == pytest.approx(1e3 / 17)


def test_cheap_nodes_buy_wider_trees_and_dear_ones_chains():
    wide = tune(costs(0.05), RANK_PROBS, max_nodes=32, max_depth=4)[0]
    narrow = tune(costs(1.5), RANK_PROBS, max_nodes=32, max_depth=4)[0]
    assert wide.tree.top_k > 1 and wide.tree.total_tokens > narrow.tree.total_tokens
    # A chain: no sibling is worth its cost, and the 4th level (0.33 tokens for 3.5 ms) just misses.
    assert narrow.tree.choices == [[0], [0, 0], [0, 0, 0]]
    # By hand: tau = 1 + .7 + .7*.75 + .7*.75*.78; one verify of 3 nodes (17 + 4.5 ms) plus drafting
    # (1.5 ms base + 2 levels of 2 ms).
    tau = 1 + 0.7 + 0.7 * 0.75 + 0.7 * 0.75 * 0.78
    assert narrow.tau == pytest.approx(tau)
    assert narrow.tokens_per_s == pytest.approx(1e3 * tau / (17 + 4.5 + 1.5 + 4))
    chain4 = predict(costs(1.5), RANK_PROBS, TreeSpec.static([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))
    assert chain4.tokens_per_s < narrow.tokens_per_s


def test_large_batches_switch_speculation_off():
    # Each extra sequence costs verification 2 ms per token: at batch 8 extra tokens are dear, and every
    # sequence drafts on its own, so plain decoding wins.
    c = costs(0.1, batch_slope=2.0)
    best, vanilla, _ = tune(c, RANK_PROBS, 32, 4, batch=1)
    assert best.tokens_per_s > 1.3 * vanilla.tokens_per_s
    best, vanilla, _ = tune(c, RANK_PROBS, 32, 4, batch=8)
    assert best.tokens_per_s < vanilla.tokens_per_s and vanilla.tokens_per_s == pytest.approx(8e3 / (17 + 2 * 7))


def test_best_shape_is_the_most_valuable_nodes():
    shape = best_shape(RANK_PROBS, 6, 4)
    # Values: .7, .525, .41, .33 down the chain; then [1] .12, [1, 0] .09 beats [0, 1] .07.
    assert shape == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1], [1, 0]]
    assert expected_tau(RANK_PROBS, shape) == pytest.approx(
        1 + 0.7 + 0.525 + 0.525 * 0.78 + 0.525 * 0.78 * 0.8 + 0.12 + 0.12 * 0.75
    )


def test_rank_counts_from_comb_steps():
    counts = RankCounts()
    counts.record(3, 2, [0, 0, 0])  # all of the chain: depths 1-3 tried and hit at rank 0
    counts.record(3, 2, [0, 1])  # depth 2 hit by the rank-1 sibling: depth 3 not tried
    counts.record(3, 2, [0])  # depth 2 tried, no candidate matched
    counts.record(3, 2, [])  # depth 1 missed
    assert counts.tried == [4, 3, 1]
    assert counts.hits == [[3, 0], [1, 1], [1, 0]]
    assert counts.rank_probs() == [[0.75, 0.0], [1 / 3, 1 / 3], [1.0, 0.0]]


def test_tree_tau_of_a_drafted_tree_is_its_shapes_expected_tau():
    target = tiny_llama(num_hidden_layers=4)
    head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, target)
    shape = comb_choices(3, 2) + [[1, 0], [1, 1]]
    proposer = Eagle(head, choices=shape)
    tokens = torch.randint(3, 300, (9,))
    proposer.reset(Sampling())
    with torch.no_grad():
        states = target(tokens[None, :-1], output_hidden_states=True).hidden_states
        proposer.update(tokens, torch.cat([states[i][0] for i in proposer.hidden_layers], -1))
        tree = proposer.propose(tokens)
    assert len(tree) == len(shape)
    assert tree_tau(RANK_PROBS, tree) == pytest.approx(expected_tau(RANK_PROBS, shape))


def test_tree_config_errors_name_the_file(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"shape": "static", "depth": 2, "top_k": 1, "total_tokens": 2}))
    with pytest.raises(ValueError, match="tree.json: choices: a static tree needs a non-empty list of rank paths"):
        load_tree_config(path)
    path.write_text("{oops")
    with pytest.raises(ValueError, match="tree.json: not valid JSON"):
        load_tree_config(path)
    config = TreeSpec.static([[0], [0, 0], [1]]).config()
    path.write_text(json.dumps(config))
    assert load_tree_config(path) == config
    assert TreeSpec.from_config(config).level_widths() == [1]


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


def test_a_rank_past_the_drafters_vocabulary_is_refused_naming_the_file(tiny_llama_from_dir, tmp_path):
    head = make_head(tiny_llama_from_dir, tmp_path, "eagle3")  # draft vocabulary 200
    choices = [[0], [200]]
    (head / "tree.json").write_text(json.dumps({"shape": "static", "choices": choices, "depth": 1, "top_k": 201,
                                                "total_tokens": 2}))  # fmt: skip
    with pytest.raises(ValueError, match=rf"{head / 'tree.json'}: choices \[200\]: rank 200 is past the 200 tokens"):
        tuned_trees({"eagle3": read_head_folder(head)}, TreeSettings().tree_spec(), ["eagle3"])
    with pytest.raises(ValueError, match=r"x.json: top_k 301 is past the 300 tokens the model t drafts from"):
        check_tree_vocab(TreeSpec.from_config(DYNAMIC | {"top_k": 301}), 300, "x.json", "the model t")


def test_a_head_folders_own_tree_json_fails_before_any_model_loads(tiny_llama_from_dir, tmp_path):
    # The user never named the file: it sits in the head folder. Neither the target nor the bench exists, so a
    # run that got as far as loading either would fail with another error.
    head = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    (head / "tree.json").write_text(json.dumps(DYNAMIC | {"depth": -3}))
    argv = ["--target", str(tmp_path / "no-target"), "--head", str(head), "--method", "eagle3"]
    with pytest.raises(ValueError, match=rf"^{head / 'tree.json'}: depth must be >= 1, got -3"):
        acceptance.main(argv + ["--bench", str(tmp_path / "no-bench.jsonl"), "--out", str(tmp_path / "r")])


@pytest.mark.parametrize("tuned_for", ["dflash2", "medusa", "eagle"])
@pytest.mark.parametrize("given", ["head folder", "--tree"])
def test_a_tree_json_tuned_for_another_drafter_is_refused_before_any_model_loads(
    tiny_llama_from_dir, tmp_path, tuned_for, given
):
    """Its shape and schedule were measured for that drafter: an EAGLE-3 head would decode with them silently."""
    head = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    tree = tmp_path / "elsewhere.json" if given == "--tree" else head / "tree.json"
    tree.write_text(json.dumps(DYNAMIC | {"method": tuned_for}))
    argv = ["--target", str(tmp_path / "no-target"), "--head", str(head), "--method", "eagle3"]
    argv += ["--tree", str(tree)] if given == "--tree" else []
    with pytest.raises(ValueError, match=rf"^{tree} was tuned for {tuned_for}, not eagle3: tune one for it"):
        acceptance.main(argv + ["--bench", str(tmp_path / "no-bench.jsonl"), "--out", str(tmp_path / "r")])
    tree.write_text(json.dumps(DYNAMIC | {"method": "eagle3"}))  # its own: taken (the missing target fails next)
    with pytest.raises(OSError):
        acceptance.main(argv + ["--bench", str(tmp_path / "no-bench.jsonl"), "--out", str(tmp_path / "r")])


def test_model_card_section_names_the_tuned_tree(tmp_path):
    assert tree_card_section(tmp_path) == []  # no tree.json: the card has no such section
    tree = TreeSpec.static([[0], [0, 0], [1]]).config() | {"machine": "Xeon, 2 torch threads", "device": "cpu"}
    tree |= {"predicted_tau": 2.5, "predicted_tokens_per_s": 90.0, "predicted_vanilla_tokens_per_s": 55.0}
    (tmp_path / "tree.json").write_text(json.dumps(tree | {"speculate_max_batch": 2}))
    (section,) = tree_card_section(tmp_path)
    assert "depth 2, top-k 2 (the most children of a node), 3 draft tokens" in section
    assert "machine Xeon, 2 torch threads, device cpu" in section and "`[[0], [1], [0, 0]]`" in section
    assert "2.50 tokens per target forward, 90.0 tokens/s (plain decoding: 55.0)" in section
    assert "up to batch size 2" in section
    schedule = [[1, 1, 3], [2, 7, 1], [8, 8, 0]]
    tree |= {"num_speculative_tokens_per_batch_size": schedule, "min_confidence": 0.25}
    (tmp_path / "tree.json").write_text(json.dumps(tree))
    (section,) = tree_card_section(tmp_path)
    assert "(vLLM `num_speculative_tokens_per_batch_size`, in the serve command above when any k > 0)" in section
    assert (
        "`[[1, 1, 3], [2, 7, 1], [8, 8, 0]]`" in section
        and "below 0.25 (estimated acceptance: the cumulative draft probability" in section
    )
    # The serve command takes the schedule, num_speculative_tokens its longest chain (vLLM caps entries at it).
    command = vllm_command("t", "d", "eagle3", 3, schedule=served_schedule(tmp_path))
    spec = json.loads(command.split("--speculative-config '")[1].rstrip("'"))
    assert spec == {"method": "eagle3", "model": "d", "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": schedule}  # fmt: skip
    (tmp_path / "tree.json").write_text(json.dumps(tree | {"num_speculative_tokens_per_batch_size": [[1, 8, 0]]}))
    assert served_schedule(tmp_path) is None  # speculation never paid: vLLM would refuse num_speculative_tokens 0


def test_cli_on_tiny_models_writes_a_tree_the_acceptance_cli_reads(tiny_target_dir, gsm8k_file, tmp_path, one_thread):
    from headstart.eval.acceptance import main as acceptance
    from headstart.eval.autotune import main

    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    head = tmp_path / "head"
    build_head({"type": "eagle3", "layer_ids": [0, 2, 4], "draft_vocab_size": 100}, target).save_pretrained(head)
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--bench", str(gsm8k_file), "--calibration", "1"]
    argv += ["--heldout", "1", "--max-new-tokens", "8", "--max-nodes", "6", "--max-depth", "3", "--comb-width", "2"]
    result = main(argv + ["--repeats", "1", "--batch-sizes", "1,2", "--out", str(tmp_path / "at"), "--write-head"])
    out = tmp_path / "at"
    assert (out / "autotune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tree | nodes |" in (out / "autotune.md").read_text()
    assert set(result["batch"]) == {"1", "2"} and len(result["costs"]["verify_ms"]["2"]) == len(
        result["costs"]["nodes"]
    )
    names = [row["name"] for row in result["grid"]]
    assert names[0] == "vanilla" and "dynamic k10 d6 n60" in names and sum(r["chosen"] for r in result["grid"]) == 1
    assert all(row["greedy_identical"] for row in result["grid"])
    tree = load_tree_config(head / "tree.json")
    assert tree == load_tree_config(out / "tree.json") and tree["total_tokens"] <= 6 and tree["depth"] <= 3
    # Speculation by load: a depth per batch size for our engine and a chain length for vLLM, both read back
    # through the schedule check, and each batch size decoded plainly, at fixed depth and as scheduled.
    for key in ("depth_per_batch_size", "num_speculative_tokens_per_batch_size"):
        assert tree[key] == result["schedules"][key] and tree[key][0][0] == 1
    depths = {b: row["depth"] for b, row in result["batch"].items()}
    assert [scheduled_depth(tree["depth_per_batch_size"], b) for b in (1, 2)] == [depths["1"], depths["2"]]
    assert [row["batch_size"] for row in result["batch_validation"]] == [1]  # one held-out prompt
    assert all(r["greedy_identical"] and r["scheduled_tokens_per_s"] > 0 for r in result["batch_validation"])
    # Adaptive depth: fitted on the calibration steps; a threshold only where it replays faster than fixed depth.
    adaptive = result["adaptive"]
    assert adaptive["level_by_level"] and tree["min_confidence"] == adaptive["min_confidence"]
    assert adaptive["replayed_tokens_per_s"] >= adaptive["replayed_fixed_tokens_per_s"]
    # eval.acceptance picks the tree up from the head folder.
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--method", "eagle3", "--bench", str(gsm8k_file)]
    report = acceptance(argv + ["--limit", "1", "--max-new-tokens", "6", "--out", str(tmp_path / "r")])
    assert report["methods"]["eagle3"]["tree_config"]["choices"] == tree["choices"]


def test_cli_tunes_a_peagle_heads_static_shape(tiny_target_dir, gsm8k_file, tmp_path, one_thread):
    # P-EAGLE drafts a tree of each depth's top candidates from one forward: the tuner calibrates it with its
    # own proposer, measures static shapes only, and eval.acceptance drafts the chosen shape with it.
    from headstart.eval.acceptance import main as acceptance
    from headstart.eval.autotune import main

    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    head = tmp_path / "head"
    options = {"type": "eagle3", "layer_ids": [0, 2, 4], "draft_vocab_size": 100, "parallel_drafting": True}
    build_head(options, target).save_pretrained(head)
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--bench", str(gsm8k_file), "--calibration", "1"]
    argv += ["--heldout", "1", "--max-new-tokens", "8", "--max-nodes", "4", "--max-depth", "3", "--comb-width", "2"]
    result = main(argv + ["--repeats", "1", "--batch-sizes", "1", "--out", str(tmp_path / "at"), "--write-head"])
    assert all(row["shape"] == "static" and row["greedy_identical"] for row in result["grid"])
    assert result["checks"]["beats_eagle_default"] is None
    assert "not measured (P-EAGLE and DFlash draft static shapes only)" in (tmp_path / "at" / "autotune.md").read_text()
    tree = load_tree_config(head / "tree.json")
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--method", "peagle", "--bench", str(gsm8k_file)]
    report = acceptance(argv + ["--limit", "1", "--max-new-tokens", "6", "--out", str(tmp_path / "r")])
    assert report["methods"]["peagle"]["tree_config"]["choices"] == tree["choices"]
    assert report["methods"]["peagle"]["greedy_identical"] is True


def test_cli_picks_the_self_spec_exit_layer_and_eval_drafts_with_it(tiny_target_dir, gsm8k_file, tmp_path, one_thread):
    # Self-speculation: every exit layer asked for is calibrated and modelled, the fastest predicted one is
    # validated and written with its tree; eval.acceptance's self_spec method drafts with that exit layer.
    from headstart.eval.acceptance import main as acceptance
    from headstart.eval.autotune import main

    argv = ["--target", str(tiny_target_dir), "--self-spec", "--exit-layers", "1,3", "--bench", str(gsm8k_file)]
    argv += ["--calibration", "1", "--heldout", "1", "--max-new-tokens", "8", "--max-nodes", "4", "--max-depth", "3"]
    result = main(argv + ["--comb-width", "2", "--repeats", "1", "--batch-sizes", "1", "--out", str(tmp_path / "at")])
    sources = {row["name"]: row for row in result["sources"]}
    assert set(sources) == {"exit layer 1", "exit layer 3"} and sum(row["chosen"] for row in sources.values()) == 1
    best = max(sources.values(), key=lambda row: row["predicted_tokens_per_s"])
    assert best["chosen"] and result["head"] == best["name"] and result["method"] == "self_spec"
    tree = load_tree_config(tmp_path / "at" / "tree.json")
    assert tree["exit_layer"] == int(best["name"].split()[-1]) and tree["method"] == "self_spec"
    assert all(row["greedy_identical"] for row in result["grid"])
    assert "| exit layer 1" in (tmp_path / "at" / "autotune.md").read_text()
    argv = ["--target", str(tiny_target_dir), "--method", "self_spec", "--bench", str(gsm8k_file), "--limit", "1"]
    report = acceptance(argv + ["--tree", str(tmp_path / "at" / "tree.json"), "--max-new-tokens", "6"] + [
        "--out", str(tmp_path / "r")])  # fmt: skip
    entry = report["methods"]["self_spec"]
    assert entry["tree_config"]["exit_layer"] == tree["exit_layer"] and entry["greedy_identical"] is True
    with pytest.raises(SystemExit):  # a tree.json for a draft model or self-speculation has no head folder to go to
        main(argv[:2] + ["--self-spec", "--write-head", "--out", str(tmp_path / "x")])
