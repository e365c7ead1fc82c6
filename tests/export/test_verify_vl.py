"""``verify_engines --families llava``: served parity on a tiny random vision-language target (issue #56).

The first tests run in ``make test``: the served Llava's shape is one vllm-cpu runs and its greedy choices are
decided by wide margins, vLLM is given our image prompts with one marker per image and the images as we decoded
them, and a target vLLM cannot load is named in vLLM's words. The ``engines`` test runs the whole command against
the real vllm-cpu from the engines venv (``make verify-engines`` runs it).
"""

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.decoding.head_proposers import head_proposer
from headstart.decoding.verify import generate
from headstart.heads import load_head
from headstart.scripts.export.verify_engines_side import spawn
from headstart.scripts.export.verify_families import parse_families
from headstart.scripts.export.verify_vl import IMAGE_PROMPTS, image_prompts, save_vl_target, vllm_image_prompts
from tests.export.test_verify_families import VLLM_CPU_HEAD_SIZES
from tests.helpers import verify_families


@pytest.fixture(scope="module")
def served_llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("served-llava") / "target"
    save_vl_target("llava", path)
    return path


def test_the_served_llava_has_a_shape_vllm_cpu_runs_and_decides_greedily_by_wide_margins(served_llava):
    model = AutoModelForImageTextToText.from_pretrained(served_llava).eval()
    text = model.config.get_text_config()
    assert text.head_dim in VLLM_CPU_HEAD_SIZES and text.hidden_size == 64
    assert (
        GenerationConfig.from_pretrained(served_llava).eos_token_id
        == AutoTokenizer.from_pretrained(served_llava).eos_token_id
    )  # vLLM stops where our engine does
    assert load_processor(str(served_llava)) is not None  # the processor vLLM's Llava builds, read back offline
    with torch.no_grad():
        logits = model(input_ids=torch.arange(10, 110)[None]).logits[0]
    top = logits.topk(2, -1).values
    assert (top[:, 0] - top[:, 1]).median() > 0.1 and logits.std() > 2


def test_vllm_is_given_our_image_prompts_with_one_marker_per_image_and_our_decoded_images(served_llava, tmp_path):
    tokenizer = load_tokenizer(str(served_llava))
    prompts = image_prompts(str(served_llava), tokenizer, 2, tmp_path)
    served = json.loads((tmp_path / IMAGE_PROMPTS).read_text())
    inputs, expanded = vllm_image_prompts(tmp_path)
    image_token = load_processor(str(served_llava)).image_token_id
    assert len(prompts) == len(inputs) == 2
    for (ids, vision), given, want, record in zip(prompts, inputs, expanded, served):
        assert ids[0].tolist() == want and (ids == image_token).sum() == 4  # 56 pixels in 28-pixel patches
        marked = given["prompt_token_ids"]
        assert marked.count(image_token) == 1
        # vLLM's Llava prompt update: the marker becomes the image's feature rows; ours gives the same tokens.
        at = marked.index(image_token)
        assert marked[:at] + [image_token] * 4 + marked[at + 1 :] == want
        (image,) = given["multi_modal_data"]["image"]
        assert image.size == (56, 56) and image.mode == "RGB"
        assert np.array_equal(np.asarray(image), np.asarray(Image.open(record["images"][0])))
        assert set(vision) >= {"pixel_values"}


# vllm-cpu 0.32.0 on the served Llava (2026-11-28), the engines venv without torchvision: the lines that matter of
# its log (the registry's traceback, then the engine's refusal).
UNINSPECTABLE_LOG = """\
(MainProcess pid=21236) ERROR 11-28 14:09:53 [registry.py:1120]   File \
"/work/main/.venv-engines/lib/python3.11/site-packages/vllm/model_executor/models/llava.py", line 61, in <module>
(MainProcess pid=21236) ERROR 11-28 14:09:53 [registry.py:1120]     from .pixtral import PixtralHFEncoderInfo
(MainProcess pid=21236) ERROR 11-28 14:09:53 [registry.py:1120]   File \
"/work/main/.venv-engines/lib/python3.11/site-packages/vllm/model_executor/models/pixtral.py", line 19, in <module>
(MainProcess pid=21236) ERROR 11-28 14:09:53 [registry.py:1120]   File \
"/work/main/.venv-engines/lib/python3.11/site-packages/transformers/models/pixtral/image_processing_pixtral.py", line 19
(MainProcess pid=21236) ERROR 11-28 14:09:53 [registry.py:1120] ModuleNotFoundError: No module named 'torchvision'
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, Model architectures ['LlavaForConditionalGeneration'] failed to be inspected. Please check the logs \
for more details. [type=value_error, input_value=ArgsKwargs((), {'model': ...}), input_type=ArgsKwargs]
"""


def test_a_target_vllm_cannot_load_is_unserved_in_its_words_with_the_import_that_failed(tmp_path):
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint({UNINSPECTABLE_LOG!r}, file=sys.stderr)\nsys.exit(1)\n")
    script.chmod(0o755)
    (tmp_path / "work").mkdir()
    assert spawn(str(script), "vllm-plain", tmp_path / "work") == {
        "status": "UNSERVED",
        "detail": "vLLM cannot load the target here: \"Model architectures ['LlavaForConditionalGeneration'] failed "
        "to be inspected: No module named 'torchvision' (at vllm/model_executor/models/pixtral.py:19)\"",
    }


def test_families_flag_takes_the_vision_language_family():
    assert parse_families("llava,qwen3_moe") == ["llava", "qwen3_moe"]


@pytest.mark.engines
def test_vllm_serves_a_vl_targets_eagle3_head_on_image_prompts_as_our_verifier_accepts_or_says_why_not(tmp_path):
    # The real command: the tiny Llava, an EAGLE-3 head trained on its image shards, image prompts on both sides.
    report = verify_families(tmp_path, "llava")["llava"]
    (entry,) = report["heads"]
    (row,) = entry["served"]
    assert report["settings"]["images"] and entry["ours"]["acceptance_length"] > 1.03  # learned: 1.067
    if row["status"] == "UNSERVED":  # vllm-cpu without torchvision cannot import its VL model files
        assert "failed to be inspected" in row["detail"] and report["status"] == "UNSERVED"
    else:
        assert report["status"] == "PASS" and row["greedy_identical"]
    # Our side, whatever vLLM did: the trained head decodes an image prompt to the target's own greedy output.
    target_dir = str(tmp_path / "llava" / "target")
    target, tokenizer = load_model(target_dir, "cpu", "fp32"), load_tokenizer(target_dir)
    head = load_head(entry["head"], target, tokenizer)
    ((ids, vision),) = image_prompts(target_dir, tokenizer, 1, tmp_path / "again")
    with torch.no_grad():
        reference = target.generate(ids, **vision, do_sample=False, max_new_tokens=32, pad_token_id=0)
        proposer = head_proposer(head.config).served_chain(head, 3)
        out, _ = generate(target, proposer, ids, 32, eos_token_id=target.generation_config.eos_token_id, vision=vision)
    assert torch.equal(out, reference)
