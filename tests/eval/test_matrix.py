"""The method x task group x temperature matrix (``eval.acceptance --temperatures``, ``eval.matrix``)."""

import json

import pytest
import torch

from headstart.data_recipes.bench import load_bench
from headstart.eval.acceptance import main
from headstart.eval.matrix import GROUPS, check_claims, pick_per_group
from tests.helpers import REPO

BENCH = [
    {"question_id": 1, "category": "coding", "turns": ["Write a loop over 3 apples.", "Now add 4 more."]},
    {"question_id": 2, "category": "coding", "turns": ["Sort the pens."]},
    {"question_id": 3, "category": "extraction", "turns": ["List the apples in: Ann has 3 apples."]},
    {"question_id": 4, "category": "qa", "turns": ["How many apples does Ann have?"]},
    {"question_id": 5, "category": "qa", "turns": ["How many pens does Tom have?"]},
    {"question_id": 6, "category": "writing", "turns": ["Tell a story about apples."]},
]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def matrix(tiny_target_dir, models, tmp_path_factory):
    """The matrix of four methods at T=0 and T=1 over two prompts per group of BENCH (one torch thread: tiny
    matmuls run faster on one than on two fighting over cores shared with other jobs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("matrix")
    bench = tmp / "spec.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in BENCH))
    argv = ["--target", str(tiny_target_dir), "--draft", str(models / "draft"), "--head", str(models / "eagle3")]
    argv += ["--method", "vanilla,ngram,draft_model,eagle3", "--bench", str(bench), "--per-group", "2"]
    argv += ["--temperatures", "0,1", "--max-new-tokens", str(NEW_TOKENS), "--depth", "3", "--tree", "static"]
    yield main([*argv, "--out", str(tmp / "out")]), tmp / "out"
    torch.set_num_threads(threads)


def test_matrix_groups_categories_and_takes_per_group_prompts(matrix):
    result, out = matrix
    # coding-like: one coding and one extraction prompt (round-robin), qa: both, creative: the one writing prompt.
    assert result["groups"] == {"coding-like": ["coding", "extraction"], "qa": ["qa"], "creative": ["writing"]}
    assert result["prompts"] == 5 and result["per_group"] == 2 and result["temperatures"] == [0.0, 1.0]
    assert [row["temperature"] for row in result["rows"]] == [0.0, 1.0]
    for row in result["rows"]:
        assert list(row["methods"]) == ["vanilla", "ngram", "draft_model", "eagle3"]
        for entry in row["methods"].values():
            assert list(entry["groups"]) == ["coding-like", "qa", "creative"]
    # Each temperature's own full report, beside the matrix.
    for folder, temperature in (("T0", 0.0), ("T1", 1.0)):
        report = json.loads((out / folder / "report.json").read_text())
        assert report["temperature"] == temperature and report["prompts"] == 5
    assert json.loads((out / "matrix.json").read_text()) == json.loads(json.dumps(result))


def test_greedy_is_identical_for_every_method_and_sampling_is_not_compared(matrix):
    greedy, sampled = matrix[0]["rows"]
    assert {m: e["greedy_identical"] for m, e in greedy["methods"].items()} == dict.fromkeys(greedy["methods"], True)
    assert {e["greedy_identical"] for e in sampled["methods"].values()} == {None}
    # A random target never says <|im_end|> within 6 tokens: every turn is 6 tokens; coding-like has 3 turns.
    vanilla = greedy["methods"]["vanilla"]["groups"]
    assert {g: c["new_tokens"] for g, c in vanilla.items()} == {"coding-like": 18, "qa": 12, "creative": 6}
    assert {g: (c["tau"], c["target_forwards"]) for g, c in vanilla.items()} == {
        "coding-like": (1.0, 18), "qa": (1.0, 12), "creative": (1.0, 6),
    }  # fmt: skip


def test_speedup_is_the_tokens_per_second_ratio_to_vanilla_on_the_same_group(matrix):
    result, out = matrix
    for row in result["rows"]:
        folder = out / f"T{row['temperature']:g}"
        report = json.loads((folder / "report.json").read_text())["methods"]
        vanilla = row["methods"]["vanilla"]["groups"]
        for name, entry in row["methods"].items():
            assert entry["speedup"] == report[name]["speedup_vs_vanilla"] and entry["tau"] == report[name]["tau"]
            cells = entry["groups"]
            assert sum(c["new_tokens"] for c in cells.values()) == report[name]["new_tokens"]
            assert sum(c["target_forwards"] for c in cells.values()) == report[name]["target_forwards"]
            for group, cell in cells.items():
                assert cell["tokens_per_s"] == pytest.approx(cell["new_tokens"] / cell["wall_s"])
                assert cell["speedup"] == pytest.approx(cell["tokens_per_s"] / vanilla[group]["tokens_per_s"])


def test_claims_plots_and_markdown_are_written(matrix):
    result, out = matrix
    claims = {c["claim"]: c for c in result["claims"]}
    coding = claims["code and structured extraction: 2.0-3.5x"]
    greedy = result["rows"][0]["methods"]
    speedups = {m: greedy[m]["groups"]["coding-like"]["speedup"] for m in ("ngram", "draft_model", "eagle3")}
    assert coding["speedup"] == max(speedups.values()) and speedups[coding["method"]] == coding["speedup"]
    low, high = coding["speedup"] >= 2.0, coding["speedup"] <= 3.5
    assert coding["verdict"] == ("does not hold" if not low else "holds" if high else "holds (above the range)")
    assert claims["chat: 1.5-2.5x"]["verdict"] == "not measured (no prompt of it)"  # no chat category in BENCH
    hot = claims["high temperature lowers acceptance (tau at T=1 < T=0)"]
    assert hot["taus"]["eagle3"] == [greedy["eagle3"]["tau"], result["rows"][1]["methods"]["eagle3"]["tau"]]
    for plot in ("speedup_per_group.png", "tau_speedup_vs_temperature.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "matrix.md").read_text()
    assert "groups: coding-like = coding + extraction; qa = qa; creative = writing" in md
    assert "## T=0: speedup (tau) per group" in md and "## T=1: speedup (tau) per group" in md
    assert f"| code and structured extraction: 2.0-3.5x | {coding['speedup']:.2f}x ({coding['method']}" in md


def _row(temperature: float, speedups: dict[str, dict[str, float]], taus: dict[str, float]) -> dict:
    methods = {
        m: {"tau": taus[m], "groups": {g: {"speedup": s} for g, s in groups.items()}} for m, groups in speedups.items()
    }
    return {"temperature": temperature, "methods": methods}


def test_claim_verdicts_from_the_numbers():
    a = {"coding-like": 2.4, "chat": 1.2, "creative": 2.0}
    b = {"coding-like": 1.1, "chat": 1.6, "creative": 0.9}
    cold = _row(0.0, {"vanilla": dict.fromkeys(a, 1.0), "a": a, "b": b}, {"vanilla": 1.0, "a": 3.0, "b": 2.0})
    hot = _row(1.0, {"vanilla": {}, "a": {}, "b": {}}, {"vanilla": 1.0, "a": 2.5, "b": 2.2})
    claims = check_claims([hot, cold])  # the speedup claims read the coldest row, whatever the order
    verdicts = {c["claim"]: (c.get("method"), c.get("speedup"), c["verdict"]) for c in claims[:3]}
    assert verdicts == {
        "code and structured extraction: 2.0-3.5x": ("a", 2.4, "holds"),
        "chat: 1.5-2.5x": ("b", 1.6, "holds"),  # the best method per group, not one method throughout
        "creative writing: 1.3-1.8x": ("a", 2.0, "holds (above the range)"),
    }
    assert claims[3]["speedups"] == {"coding-like": 2.4, "chat": 1.6, "creative": 2.0}
    assert claims[3]["verdict"] == "does not hold"  # chat 1.6 < creative 2.0
    assert claims[4]["taus"] == {"a": [3.0, 2.5], "b": [2.0, 2.2]}
    assert claims[4]["lowered"] == ["a"] and claims[4]["verdict"] == "holds for 1 of 2 methods"
    slow = _row(0.0, {"vanilla": {"coding-like": 1.0}, "a": {"coding-like": 1.4}}, {"vanilla": 1.0, "a": 2.0})
    assert check_claims([slow])[0]["verdict"] == "does not hold"
    assert check_claims([slow])[4]["verdict"] == "not measured (one temperature)"


def test_per_group_takes_the_same_count_from_every_group_of_spec_bench():
    items = pick_per_group(load_bench(REPO / "assets" / "data" / "spec_bench_question.jsonl"), 3)
    by_group: dict[str, list[str]] = {}
    for item in items:
        group = next(g for g, categories in GROUPS.items() if item.category in categories)
        by_group.setdefault(group, []).append(item.category)
    assert list(by_group) == list(GROUPS)  # every group, in GROUPS order
    assert by_group["coding-like"] == ["coding", "extraction", "coding"]  # round-robin over its categories
    assert by_group["chat"] == ["reasoning", "stem", "humanities"]
    assert by_group["math"] == ["math", "math_reasoning", "math"]  # MT-bench's math comes first in the file
    assert all(len(categories) == 3 for categories in by_group.values())


def test_limit_and_per_group_or_two_temperature_flags_are_refused(tiny_target_dir, tmp_path):
    argv = ["--target", str(tiny_target_dir), "--method", "vanilla", "--bench", "x", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="--limit .* or --per-group"):
        main([*argv, "--limit", "2", "--per-group", "1"])
    with pytest.raises(ValueError, match="--temperature .* or --temperatures"):
        main([*argv, "--temperature", "0.5", "--temperatures", "0,1"])
