"""Test-wide settings (no network, no wandb, seeded) and the fixtures the test modules share. What they share besides
fixtures (paths, builders, helpers) is in tests/helpers.py."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import (  # noqa: E402
    DRAFT,
    GSM8K_ROWS,
    TARGET,
    WIDE,
    base_config,
    save_tiny_llama,
    tiny_llama,
    without_chat_template,
    write_config,
    write_jsonl,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is much faster than two fighting over cores shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the bundled models and the tiny target saved like a real one


@pytest.fixture(scope="session")
def demo_target():
    """The bundled target (assets/demo-target): (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TARGET).eval(), AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="session")
def demo_draft():
    """The bundled draft model (assets/demo-draft): (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(DRAFT).eval(), AutoTokenizer.from_pretrained(DRAFT)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama with the bundled tokenizer's design, saved like a real HF model folder."""
    from transformers import LlamaForCausalLM

    from headstart.scripts.dev.build_demo_models import DemoModel, build_tokenizer, model_config, to_messages

    out = tmp_path_factory.mktemp("tiny-target")
    tokenizer = build_tokenizer([to_messages(r, None) for r in GSM8K_ROWS], vocab_size=400, min_frequency=1)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4}
    arch = DemoModel.model_construct(name="tiny-target", num_key_value_heads=2, tie_word_embeddings=False, **sizes)
    torch.manual_seed(0)
    LlamaForCausalLM(model_config(arch, tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory):
    """A tiny random Llava (CLIP vision tower, Llama text model) with its processor (scripts/dev/tiny_vl.py)."""
    from headstart.scripts.dev.tiny_vl import build_llava

    return build_llava(tmp_path_factory.mktemp("tiny-llava") / "target")


@pytest.fixture(scope="session")
def tiny_qwen_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL (its vision tower, an mrope text model) from scripts/dev/tiny_vl.py."""
    from headstart.scripts.dev.tiny_vl import build_qwen2_5_vl

    return build_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl") / "target")


@pytest.fixture(scope="session")
def tiny_qwen_vl(tiny_qwen_vl_dir):
    """tiny_qwen_vl_dir loaded: (model, tokenizer, processor), the processor images-only where torchvision is
    missing (``core.vision.images_only_processor``)."""
    from headstart.core.models import load_model, load_processor, load_tokenizer

    path = str(tiny_qwen_vl_dir)
    return load_model(path, "cpu", "fp32"), load_tokenizer(path), load_processor(path)


@pytest.fixture(scope="session")
def base_target(tmp_path_factory):
    """The bundled target without its chat template (a base model)."""
    return without_chat_template(TARGET, tmp_path_factory.mktemp("base-target") / "target")


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    write_jsonl(path, GSM8K_ROWS)
    return path


# ---- tiny_llama() as the unit tests' targets


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    """tiny_llama() saved as a model folder, one per test module (a target that names its folder)."""
    return save_tiny_llama(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def tiny_llama_from_dir(tiny_llama_dir):
    """tiny_llama() (vocabulary 300) loaded from its folder: a head made on it names its target, as trained ones do."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def peaked_tiny_llama():
    """tiny_llama() with a peaked lm_head (a draft's loss is not flat), frozen as core.models.load_target leaves a
    target."""
    model = tiny_llama()
    model.lm_head.weight.data *= 10
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def peaked_wide_llama():
    """tiny_llama(**WIDE) with peaked distributions, so greedy paths and acceptance mean something; frozen, as
    core.models.load_target leaves a target (the block drafters' target)."""
    model = tiny_llama(**WIDE)
    model.lm_head.weight.data *= 20
    return model.requires_grad_(False)


# ---- tiny training runs


@pytest.fixture(scope="module")
def sharp_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with a peaked lm_head: a fresh random Llama predicts near-uniformly, leaving little to learn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("sharp-target")
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    model.lm_head.weight.data *= 30
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def shards(sharp_target_dir, gsm8k_file, tmp_path_factory):
    """The tiny training data captured from sharp_target_dir (one capture per test module)."""
    from headstart.data_recipes.capture import run_capture

    out = tmp_path_factory.mktemp("train") / "shards"
    run_capture(base_config(sharp_target_dir, gsm8k_file, out, out, "eagle3"))
    return out


@pytest.fixture
def make_config(sharp_target_dir, gsm8k_file, shards, tmp_path):
    """make(head_type, name, **train): a config file for a tiny run into tmp_path / name; (config, out_dir)."""

    def make(head_type, name="run", **train):
        cfg = base_config(sharp_target_dir, gsm8k_file, shards, tmp_path / name, head_type, **train)
        return write_config(tmp_path / f"{name}.yaml", cfg), tmp_path / name

    return make


@pytest.fixture(scope="module")
def models(tiny_target_dir, tmp_path_factory):
    """A tiny draft model (the target's tokenizer) and tiny random EAGLE-3, Medusa and P-EAGLE heads, saved like
    real ones (one set per test module)."""
    from transformers import LlamaForCausalLM

    from headstart.heads import build_head

    out = tmp_path_factory.mktemp("models")
    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    torch.manual_seed(1)
    config = target.config.to_dict() | {"num_hidden_layers": 2}
    LlamaForCausalLM(type(target.config)(**config)).save_pretrained(out / "draft")
    head = build_head({"type": "eagle3", "layer_ids": [0, 2, 4], "draft_vocab_size": 100}, target)
    head.save_pretrained(out / "eagle3")
    build_head({"type": "medusa", "num_heads": 3}, target).save_pretrained(out / "medusa")
    options = {"type": "eagle3", "layer_ids": [0, 2, 4], "draft_vocab_size": 100, "parallel_drafting": True}
    build_head(options, target).save_pretrained(out / "peagle")
    return out
