"""verify_engines' verdicts: a check passes only on identical greedy tokens with drafts, and never silently."""

from scripts.verify_engines import judge_vllm, spawn

PLAIN = {"tokens": [[5, 6, 7]], "counters": {}}
OURS = {"acceptance_length": 2.0, "accepted_per_pos": [2, 1, 1]}


def spec(tokens, drafts, per_pos):
    counters = {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens_per_pos": per_pos}
    return {"tokens": tokens, "counters": counters}


def test_identical_tokens_with_drafts_pass_and_report_acceptance_length():
    verdict = judge_vllm(PLAIN, spec([[5, 6, 7]], 4, [2, 1, 1]), OURS)
    assert verdict["status"] == "PASS" and "acceptance length 2.000 (our evaluator: 2.000" in verdict["detail"]


def test_different_tokens_no_drafts_or_too_few_accepts_fail():
    assert judge_vllm(PLAIN, spec([[5, 6, 8]], 4, [2, 1, 1]), OURS)["status"] == "FAIL"
    assert judge_vllm(PLAIN, spec([[5, 6, 7]], 0, [0, 0, 0]), OURS)["status"] == "FAIL"
    # A head vLLM reads wrongly still runs and keeps greedy output, but accepts far less than ours.
    assert judge_vllm(PLAIN, spec([[5, 6, 7]], 4, [1, 0, 0]), OURS)["status"] == "FAIL"
    untrained = {"acceptance_length": 1.0, "accepted_per_pos": [0, 0, 0]}
    assert judge_vllm(PLAIN, spec([[5, 6, 7]], 4, [0, 0, 0]), untrained)["status"] == "PASS"


def test_a_check_that_cannot_run_says_why(tmp_path):
    missing = spawn(str(tmp_path / "no-python"), "vllm-plain", tmp_path)
    assert missing["status"] == "NOT RUN" and "no-python" in missing["detail"]
    assert judge_vllm(missing, spec([[5, 6, 7]], 4, [2, 1, 1]), OURS) == missing
