"""Build the bundled demo models: tokenizer, Llama target and small draft LM, trained on GSM8K.

    python -m scripts.dev.build_demo_models --config configs/build-demo-models.yaml [key=value ...]

There is no model download on the machines headstart is tested on, so the project trains its own
small, real models. The run is seeded and resumable: training checkpoints every ``ckpt_every``
steps under ``work_dir`` (atomically) and a restarted run continues from the last checkpoint with
the same data order. A finished model folder is written in one rename and skipped on re-runs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Annotated, Any, ClassVar, cast

import torch
from pydantic import Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import BatchEncoding, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from headstart.core.config_files import load_config, save_config
from headstart.core.errors import DataError
from headstart.core.io import atomic_dir, atomic_path, atomic_write_text, read_jsonl
from headstart.core.runtime import cosine_with_warmup, mix_seed, resolve_device, resolve_dtype, seed_everything
from headstart.core.settings import (
    Count,
    Device,
    Dtype,
    Float,
    Fraction,
    NonNegative,
    NonNegativeFloat,
    Positive,
    Section,
    as_dict,
    parse,
)
from headstart.data_recipes.errors import get_field


class ModelTraining(Section):
    seq_len: Count
    batch_size: Count
    steps: Count
    lr: Positive
    min_lr_ratio: Fraction
    warmup_steps: NonNegative
    weight_decay: NonNegativeFloat
    grad_clip: Positive
    dtype: Dtype  # autocast dtype
    ckpt_every: Count


class DemoModel(Section):
    name: str
    hidden_size: Count
    intermediate_size: Count
    num_hidden_layers: Count
    num_attention_heads: Count
    num_key_value_heads: Count
    tie_word_embeddings: bool
    train: ModelTraining


class DemoTokenizer(Section):
    vocab_size: Count
    min_frequency: Count


class BuildDemoModelsConfig(Section):
    """configs/build-demo-models.yaml, read by scripts/dev/build_demo_models.py."""

    command: ClassVar[str] = "build-demo-models"

    seed: NonNegative
    out_dir: str
    work_dir: str
    device: Device = "auto"
    train_file: str
    sample_file: str
    heldout_fraction: Annotated[Float, Field(ge=0, lt=1)]
    system_prompt_fraction: Fraction
    system_prompt: str
    tokenizer: DemoTokenizer
    target: DemoModel
    draft: DemoModel


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML-style template. The {% generation %} block marks assistant tokens so that
# ``apply_chat_template(..., return_assistant_tokens_mask=True)`` yields the loss mask.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role ' + message['role'] + '; expected system, user or assistant') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def read_gsm8k(path: str | Path) -> list[dict[str, str]]:
    rows = []
    for location, record in read_jsonl(path):
        try:
            rows.append({"question": get_field(record, "question"), "answer": get_field(record, "answer")})
        except DataError as err:
            raise DataError(f"not a GSM8K row: {err.message}", location) from None
    return rows


def to_messages(row: dict[str, str], system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": row["question"]})
    messages.append({"role": "assistant", "content": row["answer"]})
    return messages


def split_rows(cfg: BuildDemoModelsConfig) -> tuple[list[list[dict]], list[list[dict]]]:
    """Deterministic train/held-out split of the GSM8K rows, as chat conversations."""
    rows = read_gsm8k(cfg.train_file)
    rng = random.Random(cfg.seed)
    rng.shuffle(rows)
    conversations = [
        to_messages(row, cfg.system_prompt if rng.random() < cfg.system_prompt_fraction else None) for row in rows
    ]
    n_heldout = int(len(conversations) * cfg.heldout_fraction)
    return conversations[n_heldout:], conversations[:n_heldout]


def build_tokenizer(conversations: list[list[dict]], vocab_size: int, min_frequency: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the training text; digits split one by one (helps arithmetic)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (message["content"] for conversation in conversations for message in conversation)
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer: PreTrainedTokenizerFast, conversation: list[dict]) -> dict[str, list[int]]:
    out = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    out = cast(BatchEncoding, out)  # return_dict: transformers types the result as any of its forms
    return {"input_ids": list(out["input_ids"]), "assistant_masks": list(out["assistant_masks"])}


def pack(encoded: list[dict[str, list[int]]], seq_len: int) -> torch.Tensor:
    """Concatenate conversations and cut them into ``seq_len`` blocks (the tail is dropped)."""
    ids = [token for sample in encoded for token in sample["input_ids"]]
    n_blocks = len(ids) // seq_len
    return torch.tensor(ids[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


def model_config(arch: DemoModel, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=arch.tie_word_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",  # type: ignore[call-arg]  # a PretrainedConfig keyword LlamaConfig's stub omits
    )


def learning_rate(step: int, hp: ModelTraining) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (``cosine_with_warmup``)."""
    return hp.lr * cosine_with_warmup(step, hp.warmup_steps, hp.steps, hp.min_lr_ratio)


def batch_for_step(blocks: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The batch of global step ``step``: a pure function of (seed, step), so resume is exact."""
    steps_per_epoch = len(blocks) // batch_size
    epoch, index = divmod(step, steps_per_epoch)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(mix_seed(seed, epoch)))
    return blocks[order[index * batch_size : (index + 1) * batch_size]]


def train_model(
    model: LlamaForCausalLM, blocks: torch.Tensor, hp: ModelTraining, ckpt_path: Path, seed: int, device: torch.device
) -> dict[str, Any]:
    """Train with AdamW under autocast; checkpoint atomically and resume from ``ckpt_path``."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.lr,
        betas=(0.9, 0.95),
    )
    start, history = 0, []
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["loss_history"]
        print(f"resuming {ckpt_path} at step {start}/{hp.steps}")
    autocast_dtype = resolve_dtype(hp.dtype)
    model.train()
    bar = tqdm(range(start, hp.steps), initial=start, total=hp.steps, desc=ckpt_path.parent.name)
    t0, tokens = time.perf_counter(), 0
    for step in bar:
        batch = batch_for_step(blocks, step, hp.batch_size, seed).to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, hp)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
            loss = model(input_ids=batch, labels=batch).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}; lower lr or use fp32")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(round(loss.item(), 4))
        tokens += batch.numel()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if (step + 1) % hp.ckpt_every == 0 or step + 1 == hp.steps:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            with atomic_path(ckpt_path) as tmp:
                torch.save({**state, "loss_history": history}, tmp)
    return {"loss_history": history, "train_tokens": hp.steps * hp.batch_size * hp.seq_len}


@torch.no_grad()
def heldout_perplexity(model: LlamaForCausalLM, encoded: list[dict], device: torch.device) -> dict[str, float]:
    """Per-token perplexity over whole held-out conversations and over their assistant tokens."""
    model.eval()
    total_nll = total_n = answer_nll = answer_n = 0.0
    for sample in encoded:
        ids = torch.tensor([sample["input_ids"]], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        mask = torch.tensor(sample["assistant_masks"][1:], device=device, dtype=torch.bool)
        total_nll += nll.sum().item()
        total_n += nll.numel()
        answer_nll += nll[mask].sum().item()
        answer_n += mask.sum().item()
    return {"all_tokens": math.exp(total_nll / total_n), "assistant_tokens": math.exp(answer_nll / answer_n)}


@torch.no_grad()
def sample_generations(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, questions: list[str], device: torch.device
) -> list[dict[str, str]]:
    model.eval()
    samples = []
    for question in questions:
        encoding = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ids = cast(BatchEncoding, encoding)["input_ids"].to(device)
        # transformers types generate's self as a protocol its own models do not match.
        out = model.generate(ids, max_new_tokens=160, do_sample=False, eos_token_id=tokenizer.eos_token_id)  # type: ignore[misc]
        answer = cast(str, tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        samples.append({"question": question, "answer": answer})
    return samples


def model_card(
    name: str, model: LlamaForCausalLM, cfg: BuildDemoModelsConfig, arch: DemoModel, stats: dict[str, Any]
) -> str:
    hp = arch.train
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"# {name}",
        "",
        "A small Llama-architecture causal LM bundled with headstart so that its demo, tests and benchmarks run "
        "offline. Trained from scratch by `python -m scripts.dev.build_demo_models` on the GSM8K training split "
        "(MIT licence, see `assets/data/GSM8K_LICENSE`), question as the user turn and the step-by-step answer "
        "as the assistant turn, under the ChatML-style chat template in `tokenizer_config.json`.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {params:,} ({params / 1e6:.1f}M) |",
        f"| layers / hidden / heads / kv heads | {arch.num_hidden_layers} / {arch.hidden_size} / "
        f"{arch.num_attention_heads} / {arch.num_key_value_heads} |",
        f"| vocabulary | {model.config.vocab_size} (byte-level BPE, digits split) |",
        f"| tied embeddings | {arch.tie_word_embeddings} |",
        f"| training tokens | {stats['train_tokens']:,} ({hp.steps} steps x {hp.batch_size} x {hp.seq_len}) |",
        f"| final training loss | {stats['final_loss']:.3f} (mean of the last 20 steps) |",
        f"| held-out perplexity, all tokens | {stats['perplexity']['all_tokens']:.2f} |",
        f"| held-out perplexity, assistant tokens | {stats['perplexity']['assistant_tokens']:.2f} |",
        f"| held-out set | {stats['heldout_conversations']} GSM8K training rows never trained on "
        f"({cfg.heldout_fraction:.0%}, seed {cfg.seed}) |",
        f"| training time | {stats['train_seconds'] / 60:.1f} min on {stats['machine']} |",
        "| weights | bf16 safetensors |",
        "",
        "## Sample generations (greedy, GSM8K test questions)",
        "",
    ]
    for sample in stats["samples"]:
        lines += [f"**Q:** {sample['question']}", "", "```", sample["answer"], "```", ""]
    lines += [
        "It is a toy: it imitates GSM8K's format and gets most arithmetic wrong. Do not use it for anything "
        "but exercising headstart."
    ]
    return "\n".join(lines) + "\n"


def build_model(
    role: str,
    cfg: BuildDemoModelsConfig,
    tokenizer: PreTrainedTokenizerFast,
    train_encoded: list[dict],
    heldout_encoded: list[dict],
    device: torch.device,
) -> None:
    arch = cfg.target if role == "target" else cfg.draft
    out = Path(cfg.out_dir) / arch.name
    if (out / "model.safetensors").exists() and (out / "README.md").exists():
        print(f"{out} is complete; skipping (delete it to rebuild)")
        return
    seed_everything(cfg.seed)
    # transformers types PreTrainedModel.to through a decorator that loses self: it takes a device.
    model = LlamaForCausalLM(model_config(arch, tokenizer)).to(device)  # type: ignore[arg-type]
    blocks = pack(train_encoded, arch.train.seq_len)
    params = sum(p.numel() for p in model.parameters())
    print(f"{role}: {params / 1e6:.1f}M parameters, {blocks.numel():,} training tokens per epoch")
    t0 = time.perf_counter()
    stats = train_model(model, blocks, arch.train, Path(cfg.work_dir) / arch.name / "ckpt.pt", cfg.seed, device)
    questions = [row["question"] for row in read_gsm8k(cfg.sample_file)[:3]]
    stats.update(
        train_seconds=time.perf_counter() - t0,
        machine=f"{torch.get_num_threads()} CPU threads"
        if device.type == "cpu"
        else torch.cuda.get_device_name(device),
        final_loss=sum(stats["loss_history"][-20:]) / len(stats["loss_history"][-20:]),
        perplexity=heldout_perplexity(model, heldout_encoded, device),
        heldout_conversations=len(heldout_encoded),
        samples=sample_generations(model, tokenizer, questions, device),
    )
    print(f"{role}: held-out perplexity {stats['perplexity']}")
    with atomic_dir(out) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(
            do_sample=False,
            max_new_tokens=256,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(arch.name, model, cfg, arch, stats))
        (tmp / "training_stats.json").write_text(json.dumps({k: v for k, v in stats.items()}, indent=1))
        save_config(as_dict(cfg), tmp / "build_config.yaml")
    print(f"wrote {out}")


def load_or_build_tokenizer(
    cfg: BuildDemoModelsConfig, train_conversations: list[list[dict]]
) -> PreTrainedTokenizerFast:
    path = Path(cfg.work_dir) / "tokenizer"
    if not (path / "tokenizer.json").exists():
        tokenizer = build_tokenizer(train_conversations, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
        with atomic_dir(path) as tmp:
            tokenizer.save_pretrained(tmp)
    return PreTrainedTokenizerFast.from_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/build-demo-models.yaml")
    parser.add_argument("--only", choices=["target", "draft"], help="build one model only")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    cfg = parse(load_config(args.config, args.overrides), BuildDemoModelsConfig, args.config)
    device = resolve_device(cfg.device)
    train_conversations, heldout_conversations = split_rows(cfg)
    tokenizer = load_or_build_tokenizer(cfg, train_conversations)
    train_encoded = [encode(tokenizer, c) for c in tqdm(train_conversations, desc="tokenize")]
    heldout_encoded = [encode(tokenizer, c) for c in heldout_conversations]
    atomic_write_text(Path(cfg.work_dir) / "resolved_config.json", json.dumps(as_dict(cfg), indent=1))
    for role in ["target", "draft"] if args.only is None else [args.only]:
        build_model(role, cfg, tokenizer, train_encoded, heldout_encoded, device)


if __name__ == "__main__":
    main()
