"""Acceptance reports: benchmark loaders and the items they refuse, the speedup model, and a full report run on tiny
models."""

import json
import re
import shutil

import pytest
from transformers import AutoTokenizer

from headstart.core.acceptance import chain_acceptance
from headstart.core.errors import DataError
from headstart.data_recipes.bench import load_bench
from headstart.data_recipes.prompts import render
from headstart.eval import acceptance
from headstart.eval.acceptance import main
from headstart.eval.report import markdown
from headstart.eval.results import read_methods
from headstart.eval.speedup import predicted_speedup
from tests.helpers import REPO, write_jsonl

SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Ann has 3 apples.", "Now she buys 4 more. How many?"]},
    {"question_id": 82, "category": "writing", "turns": ["Tom has 5 pens."]},
    {"question_id": 83, "category": "math", "turns": ["How many apples does Ann have if she buys 2?"]},
    {"question_id": 84, "category": "math", "turns": ["She has 7 apples."]},
]


def test_spec_bench_is_multi_turn_and_limit_covers_every_category(tmp_path):
    path = write_jsonl(tmp_path / "spec.jsonl", SPEC_BENCH)
    items = load_bench(path)
    assert [i.id for i in items] == ["81", "82", "83", "84"]
    assert items[0].turns == SPEC_BENCH[0]["turns"] and items[0].category == "writing" and items[0].history == []
    # The file is sorted by category; a limit still takes from each, round-robin in file order.
    assert [i.id for i in load_bench(path, limit=3)] == ["81", "83", "82"]


def test_bundled_benchmarks_load():
    spec = load_bench(REPO / "assets" / "data" / "spec_bench_question.jsonl", limit=13)
    assert len({i.category for i in spec}) == 13  # one prompt from each Spec-Bench category
    assert spec[0].id == "81" and len(spec[0].turns) == 2
    gsm8k = load_bench(REPO / "assets" / "data" / "gsm8k_test.jsonl", limit=5)
    assert len(gsm8k) == 5 and {i.category for i in gsm8k} == {"gsm8k"}


def test_gsm8k_messages_and_prompt_records(tmp_path):
    gsm8k = load_bench(write_jsonl(tmp_path / "gsm.jsonl", [{"question": "What is 2+2?", "answer": "#### 4"}]))
    assert gsm8k[0].category == "gsm8k" and gsm8k[0].turns == ["What is 2+2?"]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Add 1 and 1."},
        {"role": "assistant", "content": "2"},  # a reference answer: dropped
    ]
    rows = [{"messages": chat, "category": "chat"}, {"prompt": "Tell me a story."}]
    items = load_bench(write_jsonl(tmp_path / "mine.jsonl", rows))
    assert items[0].turns == ["Add 1 and 1."] and items[0].history == chat[:3] and items[0].category == "chat"
    assert items[1].turns == ["Tell me a story."] and items[1].category == "mine"  # the file's name
    assert items[1].id == f"{tmp_path / 'mine.jsonl'}:2"


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", "not valid JSON"),
        ({"turns": ["hi"]}, "needs 'category'"),
        ({"category": "x", "turns": []}, "'turns' must be"),
        ({"prompt": ""}, "'prompt' must be"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "user message"),
        ({"body": "hi"}, "unknown record shape"),  # {"text": ...} is a prompt
    ],
)
def test_bad_records_name_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "", row])
    with pytest.raises(DataError, match=message) as err:
        load_bench(path)
    assert str(err.value).startswith(f"{path}:3: ")


def test_render_uses_the_chat_template(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = render(tokenizer, [{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_predicted_speedup_known_values():
    # (1 - 0.8^5) / 0.2 = 3.3616 tokens per forward; a step costs 4 * 0.1 + 1 = 1.4 forwards.
    assert predicted_speedup(0.8, 0.0, 4) == pytest.approx(3.3616)
    assert predicted_speedup(0.8, 0.1, 4) == pytest.approx(3.3616 / 1.4)
    assert predicted_speedup(0.0, 0.5, 3) == pytest.approx(1 / 2.5)  # nothing accepted: pure overhead
    assert predicted_speedup(1.0, 0.0, 4) == pytest.approx(5.0)
    assert predicted_speedup(0.3, 0.0, 0) == pytest.approx(1.0)  # no drafting is vanilla


def test_chain_acceptance_counts_tries_per_depth():
    # Steps (tree depth, accepted drafts). Depth 1: tried 5 times, accepted 4. Depth 2: tried by the 4
    # steps that accepted depth 1, accepted by 2. Depth 3: the depth-2 tree that accepted 2 has no depth 3,
    # so tried once, accepted once.
    by_depth, alpha = chain_acceptance([3, 3, 2, 3, 3], [0, 1, 2, 1, 3])
    assert by_depth == pytest.approx([4 / 5, 2 / 4, 1 / 1])
    assert alpha == pytest.approx(7 / 10)
    assert chain_acceptance([2, 2], [0, 0]) == ([0.0, None], 0.0)  # depth 2 never reached
    assert chain_acceptance([0, 0], [0, 0]) == ([], 0.0)  # vanilla: nothing drafted


def test_report_run_on_tiny_models(tiny_target_dir, models, tmp_path):
    bench = write_jsonl(tmp_path / "spec.jsonl", SPEC_BENCH)
    out = tmp_path / "report"
    argv = ["--target", str(tiny_target_dir), "--draft", str(models / "draft")]
    argv += ["--head", str(models / "eagle3"), "--head", str(models / "medusa")]
    argv += ["--method", "vanilla,ngram,draft_model,eagle3,medusa", "--bench", str(bench), "--limit", "3"]
    argv += ["--max-new-tokens", "12", "--depth", "3", "--top-k-draft", "2", "--total-tokens", "6", "--out", str(out)]
    main(argv)
    report = json.loads((out / "report.json").read_text())
    for key in ("machine", "target", "bench", "temperature", "limit", "max_new_tokens", "torch", "transformers"):
        assert key in report
    assert report["limit"] == 3 and report["prompts"] == 3 and report["temperature"] == 0.0
    methods = report["methods"]
    assert list(methods) == ["vanilla", "ngram", "draft_model", "eagle3", "medusa"]
    for name, entry in methods.items():
        assert entry["greedy_identical"] is True, name
        assert isinstance(entry["acceptance_by_depth"], list)
        assert all(r is None or 0.0 <= r <= 1.0 for r in entry["acceptance_by_depth"])
        assert entry["tau"] == pytest.approx(1 + entry["mean_accepted"]) and entry["tau"] >= 1.0
        assert entry["tokens_per_s"] > 0 and entry["predicted_speedup"] > 0 and entry["peak_memory_mb"] > 0
        assert set(entry["per_category"]) == {"writing", "math"}
        # The categories split the method's tokens and forwards; each has its own speedup over vanilla's.
        assert sum(c["target_forwards"] for c in entry["per_category"].values()) == entry["target_forwards"]
        for category, stats in entry["per_category"].items():
            base = methods["vanilla"]["per_category"][category]["tokens_per_s"]
            assert stats["speedup_vs_vanilla"] == pytest.approx(stats["tokens_per_s"] / base)
        # Prompt 81 has two turns, each of 12 new tokens (a random target never says <|im_end|> this soon).
        assert entry["new_tokens"] == 4 * 12
    vanilla = methods["vanilla"]
    assert vanilla["tau"] == 1.0 and vanilla["speedup_vs_vanilla"] == 1.0 and vanilla["acceptance_by_depth"] == []
    assert vanilla["target_forwards"] == 4 * 12 and vanilla["requested"] is True
    # Depth-limited drafters: chains of 3 (ngram, draft model), trees of depth <= 3 (EAGLE-3, 3 Medusa heads).
    assert methods["draft_model"]["draft_depth"] == 3 and len(methods["draft_model"]["acceptance_by_depth"]) == 3
    assert 1 <= methods["eagle3"]["draft_depth"] <= 3 and methods["medusa"]["draft_depth"] == 3
    # The tree each method really drafted, beside what the flags asked for: the draft model's chains of 3.
    assert methods["draft_model"]["drafted_nodes"] == 3 and methods["vanilla"]["drafted_nodes"] == 0
    assert 1 <= methods["eagle3"]["drafted_nodes"] <= 6
    for plot in ("tau_per_category.png", "acceptance_by_depth.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "| method | tau |" in md and "| eagle3 |" in md and "WARNING" not in md
    assert "| vanilla | 1.000 (1.00x) | 1.000 (1.00x) |" in md  # per category: tau (speedup)
    assert "tree per method (top-k 2, depth 3, 6 nodes) asked; each method's row says the deepest" in md
    assert "| draft_model | " in md and "| 3, 3 |" in md.split("| draft_model | ")[1].split("\n")[0]
    as_file = report | {"tree": report["tree"] | {"shape": "t.json", "file": "t.json"}}
    said = markdown(as_file | {"methods": read_methods(report)})
    assert "tree t.json (a tree.json) asked" in said and "top-k 2, depth 3" not in said
    report["methods"]["eagle3"] |= {"greedy_identical": False, "mismatched_prompts": ["83"]}
    assert "WARNING: eagle3 did NOT reproduce vanilla greedy decoding" in markdown(
        report | {"methods": read_methods(report)}
    )


def test_head_folder_tree_json_and_training_prediction_reach_the_report(tiny_target_dir, models, tmp_path):
    head = tmp_path / "eagle3"
    shutil.copytree(models / "eagle3", head)
    config = json.loads((head / "config.json").read_text())
    config["training"] = {"heldout_top1": [0.5, 0.4], "predicted_tau": 1.7, "measured_tau": 1.6, "step": 10}
    (head / "config.json").write_text(json.dumps(config))
    tree = {"shape": "static", "choices": [[0], [1], [0, 0]], "depth": 2, "top_k": 2, "total_tokens": 3}
    (head / "tree.json").write_text(json.dumps(tree | {"machine": "test box"}))
    bench = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Ann has 3 apples."}])
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--method", "eagle3", "--bench", str(bench)]
    report = main(argv + ["--max-new-tokens", "8", "--depth", "5", "--out", str(tmp_path / "r")])
    eagle3, vanilla = report["methods"]["eagle3"], report["methods"]["vanilla"]
    assert eagle3["predicted_tau"] == 1.7 and vanilla["predicted_tau"] is None
    assert eagle3["training_measured_tau"] == 1.6 and vanilla["training_measured_tau"] is None
    assert eagle3["tree_config"]["choices"] == tree["choices"] and eagle3["draft_depth"] == 2  # not --depth 5
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| eagle3 | " in md and " | 1.700 | 1.600 | " in md and "tuned on test box" in md
    # --tree static (chains of --depth) overrides the folder's tree.json.
    report = main(argv + ["--max-new-tokens", "8", "--tree", "static", "--depth", "4", "--out", str(tmp_path / "d")])
    assert report["methods"]["eagle3"]["tree_config"] is None and report["methods"]["eagle3"]["draft_depth"] == 4


def test_peagle_and_eagle3_heads_are_two_methods_of_one_run(tiny_target_dir, models, tmp_path):
    # Both heads are type eagle3; the one with parallel_drafting is method peagle: chains of --depth from one forward.
    bench = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Ann has 3 apples."}, {"prompt": "Bob has 5 pears."}])
    argv = ["--target", str(tiny_target_dir), "--head", f"{models / 'eagle3'},{models / 'peagle'}"]
    argv += ["--method", "eagle3,peagle", "--bench", str(bench), "--tree", "static", "--depth", "3"]
    report = main(argv + ["--max-new-tokens", "10", "--out", str(tmp_path / "r")])
    assert report["heads"] == {"eagle3": str(models / "eagle3"), "peagle": str(models / "peagle")}
    peagle = report["methods"]["peagle"]
    assert peagle["greedy_identical"] is True and peagle["new_tokens"] == 20
    assert peagle["draft_depth"] == 3 and len(peagle["acceptance_by_depth"]) == 3
    with pytest.raises(ValueError, match="method 'peagle' needs a --head whose config type is 'eagle3' with parallel"):
        main(argv[:2] + ["--head", str(models / "eagle3"), "--method", "peagle"] + argv[6:] + ["--out", str(tmp_path)])


def test_vanilla_runs_as_baseline_when_not_requested(tiny_target_dir, models, tmp_path, capsys):
    bench = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Ann has 3 apples."}])
    argv = ["--target", str(tiny_target_dir), "--draft", str(models / "draft"), "--head", str(models / "medusa")]
    argv += ["--method", "draft_model,medusa", "--bench", str(bench), "--tree", "dynamic", "--depth", "3"]
    report = main(argv + ["--max-new-tokens", "6", "--temperature", "0.8", "--out", str(tmp_path / "r")])
    methods = report["methods"]
    assert list(methods) == ["vanilla", "draft_model", "medusa"] and methods["vanilla"]["requested"] is False
    assert methods["medusa"]["greedy_identical"] is None  # sampling: no token-for-token claim
    assert methods["draft_model"]["new_tokens"] == 6 and 1 <= methods["draft_model"]["draft_depth"] <= 3
    assert "not requested" in capsys.readouterr().err
    assert "Vanilla was not requested" in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "vanilla,eagle3"], "method 'eagle3' needs a --head whose config type is 'eagle3'"),
        (["--method", "medusa", "--head", "HEAD"], "needs a --head whose config type is 'medusa'.*eagle3"),
        (["--method", "eagle3", "--head", "HEAD,HEAD"], "both eagle3 heads"),
        (["--method", "draft_model"], "needs --draft"),
        (["--method", "vanilla", "--head", "HEAD"], "not in --method"),
    ],
)
def test_missing_head_or_draft_fails_before_any_work(models, tmp_path, extra, message):
    # The target and bench do not exist: the check must come before anything is loaded.
    extra = [a.replace("HEAD", str(models / "eagle3")) for a in extra]
    argv = ["--target", str(tmp_path / "none"), "--bench", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=message):
        main(argv + extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "vanilla,beam"], r"--method\[1\] must be one of 'vanilla', .* got 'beam'"),
        (["--method", "vanilla", "--attn-implementation", ""], "--attn-implementation must be auto, eager, .* got ''"),
        (["--method", "vanilla", "--attn-implementation", "flashy"], "--attn-implementation must be .* got 'flashy'"),
    ],
)
def test_a_misspelt_method_or_attention_kernel_is_refused_by_the_flags_with_exit_2(tmp_path, capsys, extra, message):
    # The target and bench do not exist: the flags are refused before anything is loaded.
    argv = ["--target", str(tmp_path / "none"), "--bench", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        main(argv + extra)
    assert stop.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n' + '{"prompt": "Café?"}'.encode("latin-1") + b"\n")
    with pytest.raises(DataError) as err:
        load_bench(path)
    assert str(err.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at byte 16 of the line): re-encode the file as UTF-8"


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
    from tests.helpers import TARGET

    bench = tmp_path / "long.jsonl"
    long_question = "How many apples? " * 400  # ~1,600 tokens against the bundled target's 1,024 positions
    bench.write_text(json.dumps({"question_id": 7, "category": "math", "turns": [long_question]}) + "\n")
    flags = ["--target", str(TARGET), "--method", "vanilla", "--bench", str(bench), "--max-new-tokens", "8"]
    with pytest.raises(ValueError, match=r"bench item 7 \(math\) can reach \d+ tokens .* past the target's 1024"):
        acceptance.main([*flags, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
