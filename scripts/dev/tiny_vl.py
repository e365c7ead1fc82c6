"""Tiny random vision-language targets, built offline from transformers' own config classes: a Qwen2.5-VL (its
vision tower, mrope text model), a Qwen3-VL (deepstack, interleaved mrope), a Llava (a CLIP vision tower, a Llama
text model) and a Gemma-3 (a SigLIP vision tower), each saved with a processor
made from its component classes (the image processor, the bundled demo tokenizer with the family's image tokens
added, a chat template that renders image parts) so that ``AutoProcessor.from_pretrained`` reads it back.

    python -m scripts.dev.tiny_vl --family qwen2_5_vl --out /tmp/tiny-qwen2_5_vl

The tests build them into a temporary folder (a second or two each); nothing is downloaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    CLIPImageProcessorPil,
    Gemma3Config,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    LlavaConfig,
    LlavaProcessor,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
)
from transformers.utils import is_torchvision_available

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "demo-target"
# The text model every family shares: 4 layers so that EAGLE-3 fuses three distinct ones ([1, 2, 3]).
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
IMAGE_SIDE = 56  # pixels: Qwen2.5-VL's 14-pixel patches merged 2x2 make 4 image tokens; CLIP's 28 make 4 too

# The demo tokenizer's chat format (ChatML), where a user turn's content may be a list of parts: each image part
# renders the family's image marker (``image``), each text part its text.
_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{%- if message['role'] == 'assistant' -%}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{%- else -%}{{ message['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ IMAGE }}{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def chat_template(image_marker: str) -> str:
    return _CHAT_TEMPLATE.replace("IMAGE", repr(image_marker))


def demo_tokenizer(extra: list[str], image_marker: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.add_tokens(extra, special_tokens=True)
    tokenizer.chat_template = chat_template(image_marker)
    return tokenizer


def build_qwen2_5_vl(out: Path, seed: int = 0) -> Path:
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer = demo_tokenizer(names, "<|vision_start|><|image_pad|><|vision_end|>")
    ids = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in names}  # type: ignore[arg-type]
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    text = dict(
        TEXT,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        # mrope: the rotary half of each head split over (time, height, width): sums to head_dim // 2
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert head_dim // 2 == 8
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT["hidden_size"],
        fullatt_block_indexes=[1],
        window_size=56,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    pixels = IMAGE_SIDE * IMAGE_SIDE
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels})
    if not is_torchvision_available():
        # Qwen2_5_VLProcessor holds a video processor, which transformers builds only with torchvision: without it
        # the folder gets the processor's parts (the image processor, the tokenizer), as a hub checkpoint has them,
        # and core.models.load_processor builds the processor class from them with images only.
        return _save(out, config, [image_processor, tokenizer], seed)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return _save(out, config, [processor], seed)


def build_llava(out: Path, seed: int = 0, text_shape: dict[str, int] | None = None, logit_scale: float = 1.0) -> Path:
    """``text_shape``: the text model's sizes over ``TEXT``'s; ``logit_scale``: ``lm_head`` times this (peaked
    predictions: ``scripts.export.verify_vl``'s served target)."""
    tokenizer = demo_tokenizer(["<image>"], "<image>")
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIDE,
        patch_size=28,
        projection_dim=32,
    )
    text = dict(
        TEXT | (text_shape or {}),
        model_type="llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=int(tokenizer.convert_tokens_to_ids("<image>")),  # type: ignore[arg-type]
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    side = {"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    image_processor = CLIPImageProcessorPil(size=side, crop_size=side)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=28,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
    )
    return _save(out, config, [processor], seed, logit_scale)


def _save(out: Path, config: object, processors: list[Any], seed: int, logit_scale: float = 1.0) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.get_output_embeddings().weight.data *= logit_scale
    model.save_pretrained(out)
    for processor in processors:
        processor.save_pretrained(out)
    return out


def build_qwen3_vl(out: Path, seed: int = 0) -> Path:
    """Qwen3-VL: 16-pixel patches merged 2 x 2 (the bundled 56-pixel images resized to 64: 4 image tokens), its
    vision tower's deepstack features added to the first text layer's states, interleaved mrope."""
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer = demo_tokenizer(names, "<|vision_start|><|image_pad|><|vision_end|>")
    ids = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in names}  # type: ignore[arg-type]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = dict(TEXT, vocab_size=len(tokenizer), max_position_embeddings=1024, head_dim=16, rope_parameters=rope)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        out_hidden_size=TEXT["hidden_size"],
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    config = Qwen3VLConfig(
        text_config=text | _special_ids(tokenizer),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    pixels = 64 * 64
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=16, merge_size=2
    )
    return _save(out, config, [image_processor, tokenizer], seed)


def build_gemma3(out: Path, seed: int = 0) -> Path:
    """Gemma-3 with its SigLIP vision tower (Gemma3ForConditionalGeneration): 14-pixel patches pooled to 4 image
    tokens, each image written by its processor as ``\n\n<start_of_image>`` + 4 soft tokens + ``<end_of_image>\n\n``
    (the chat template writes the start marker alone), its rows attending to each other both ways in the prefill."""
    markers = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER, extra_special_tokens=markers)
    tokenizer.chat_template = chat_template(markers["boi_token"])
    text = dict(TEXT, vocab_size=len(tokenizer), max_position_embeddings=1024, head_dim=16, sliding_window=32)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIDE
    )
    config = Gemma3Config(
        text_config=text | _special_ids(tokenizer),
        vision_config=vision | {"patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    processor = Gemma3Processor(image_processor, tokenizer, tokenizer.chat_template, image_seq_length=4)
    return _save(out, config, [processor], seed)


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


BUILDERS: dict[str, Callable[[Path, int], Path]] = {
    "qwen2_5_vl": build_qwen2_5_vl,
    "qwen3_vl": build_qwen3_vl,
    "gemma3": build_gemma3,
    "llava": build_llava,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(BUILDERS), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(BUILDERS[args.family](Path(args.out), args.seed))


if __name__ == "__main__":
    main()
