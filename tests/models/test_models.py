"""The model and its loaders against transformers: every family, the paged
KV path, sharded safetensors, GGUF files of each quantization, and the real
default SmolLM2 GGUF."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from support_gguf import byte_level_tokenizer_metadata, write_gguf
from support_models import BYTE_LEVEL_VOCAB, TINY_SIZES, tiny_families

from atom_anyio.models.attention import AttentionMetadata
from atom_anyio.models.decoder import pack_weights
from atom_anyio.models.gguf_file import GGUF_ARCHITECTURES, load_gguf_weights
from atom_anyio.models.loader import build_model, load_model

SIZES = TINY_SIZES
VOCAB = SIZES["vocab_size"]
FAMILIES = tiny_families("llama", "llama3-rope", "qwen2", "qwen3", "mistral")


def random_hf_model(family: str) -> transformers.PreTrainedModel:
    """A seeded tiny model whose norm weights and biases are random too, so a
    swapped norm or a dropped bias changes the logits."""
    config_class, extra = FAMILIES[family]
    config = config_class(**SIZES, **extra, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    model = random_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    copy_tokenizer(request.getfixturevalue("tiny_model_dir"), path)
    return model, path


def copy_tokenizer(source, target) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target)


def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PagedRun:
    """Drives a model step by step through a paged KV cache whose blocks are
    handed out in shuffled order, so every sequence's blocks are scattered."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 32):
        cfg = model.config
        shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.model, self.block_size = model, block_size
        dtype = model.lm_head.weight.dtype
        self.kv = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_hidden_layers)
        ]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables: dict[str, list[int]] = {}

    def step(self, chunks: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """Run ``(seq, tokens, start)`` chunks as one batch; logits per chunk."""
        ids, positions, tables, context_lens, query_lens = [], [], [], [], []
        for seq, tokens, start in chunks:
            table, end = self.tables.setdefault(seq, []), start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            tables.append(table)
            context_lens.append(end)
            query_lens.append(len(tokens))
        meta = AttentionMetadata.build(tables, context_lens, query_lens, self.block_size, torch.device("cpu"))
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv)
            return list(self.model.compute_logits(hidden).split(query_lens))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4):
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_one_prefill_matches_transformers(family_dir):
    hf, path = family_dir
    loaded = load_model(str(path))
    prompt = random_tokens(13, seed=2)
    (logits,) = PagedRun(loaded.model).step([("a", prompt, 0)])
    assert_logits_close(logits, hf_logits(hf, prompt))


def test_chunked_prefill_and_mixed_batches_match_transformers(family_dir):
    hf, path = family_dir
    model = load_model(str(path)).model
    seqs = {"a": random_tokens(14, seed=3), "b": random_tokens(11, seed=4)}
    refs = {name: hf_logits(hf, tokens) for name, tokens in seqs.items()}
    steps = [
        [("a", 0, 6)],  # fresh prefill
        [("a", 6, 11), ("b", 0, 5)],  # chunk after a cached prefix, batched with a new prompt
        [("a", 11, 12), ("b", 5, 9)],  # decode + prefill chunk
        [("a", 12, 13), ("b", 9, 10)],  # decodes
        [("a", 13, 14), ("b", 10, 11)],
    ]
    run = PagedRun(model)
    for step in steps:
        outputs = run.step([(name, seqs[name][start:end], start) for name, start, end in step])
        for (name, start, end), logits in zip(step, outputs, strict=True):
            assert_logits_close(logits, refs[name][start:end])


def test_loaded_model_is_frozen_in_eval_mode_with_tied_head(tiny_model):
    model = tiny_model.model
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tiny_model.name == "tiny-llama"
    assert "<|im_start|>" in tiny_model.chat_template


def test_bfloat16_load_keeps_rope_frequencies_in_float32(tiny_model_dir, tiny_model):
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.inv_freq.dtype == torch.float32
    prompt = random_tokens(9, seed=5)
    (ours,) = PagedRun(loaded.model).step([("a", prompt, 0)])
    (ref,) = PagedRun(tiny_model.model).step([("a", prompt, 0)])
    assert ours.argmax(-1).eq(ref.argmax(-1)).float().mean() > 0.8


def test_sharded_safetensors_load_the_same_weights(tmp_path, tiny_model_dir):
    hf = random_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    copy_tokenizer(tiny_model_dir, tmp_path)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), batch_invariant=False)  # the matrices as loaded (not packed into panels)
    ours = loaded.model.state_dict()
    expected, missing = pack_weights(hf.state_dict())  # q/k/v and gate/up concatenated
    assert not missing and "model.layers.0.self_attn.qkv_proj.weight" in expected
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name


def test_generation_config_eos_ids_are_added(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(str(tmp_path)).config.eos_token_ids == (2, 7)


@pytest.mark.parametrize("change", ["missing", "unknown"])
def test_weights_that_do_not_match_the_config_are_refused(tmp_path, tiny_model_dir, change):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    weights = safetensors.torch.load_file(tmp_path / "model.safetensors")
    if change == "missing":
        del weights["model.layers.1.mlp.up_proj.weight"]
    else:
        weights["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    safetensors.torch.save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{change} \[.*up_proj|{change} \[.*extra"):
        load_model(str(tmp_path))


# GGUF files written the way llama.cpp's converter writes them

GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF architecture -> family
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]


@pytest.fixture(scope="module")
def gguf_families():
    return {arch: random_hf_model(family) for arch, family in GGUF_ARCHS.items()}


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_gguf_weights_dequantize_and_match_transformers(tmp_path, gguf_families, arch, qtype):
    hf = gguf_families[arch]
    path = tmp_path / f"tiny-{arch}.{qtype}.gguf"
    expected = write_gguf(path, arch, hf, qtype)
    cfg, state = load_gguf_weights(str(path))
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (
        32 if arch == "qwen3" else 16,
        VOCAB,
        arch == "qwen2",
    )
    assert (cfg.attention_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict(expected, strict=False)  # a tied head follows the embedding in place
    prompt = random_tokens(10, seed=6)
    (logits,) = PagedRun(build_model(cfg, state, torch.float32, torch.device("cpu"))).step([("a", prompt, 0)])
    assert_logits_close(logits, hf_logits(reference, prompt))


def llama_cpp_rope_factors(cfg: transformers.PretrainedConfig) -> np.ndarray:
    """``rope_freqs`` as llama.cpp's convert_hf_to_gguf.py writes it for Llama 3 rope scaling."""
    rope = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_rope_freqs_apply_llama3_rope_scaling_like_transformers(tmp_path):
    rope = dict(FAMILIES["llama3-rope"][1]["rope_parameters"], original_max_position_embeddings=32)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SIZES, rope_parameters=rope, initializer_range=0.2)
    ).eval()
    path = tmp_path / "tiny-llama31.gguf"
    factors = llama_cpp_rope_factors(hf.config)
    assert {1.0, 8.0} < set(factors.tolist())  # all three llama3 bands: kept, smoothed, scaled
    write_gguf(path, "llama", hf, "F32", metadata=[lambda w: w.add_tensor("rope_freqs.weight", factors)])
    cfg, state = load_gguf_weights(str(path))
    assert cfg.rope_freq_factors is not None and "rope_freqs.weight" not in state
    prompt = random_tokens(40, seed=7)  # past the original 16 positions
    (logits,) = PagedRun(build_model(cfg, state, torch.float32, torch.device("cpu")), num_blocks=16).step(
        [("a", prompt, 0)]
    )
    assert_logits_close(logits, hf_logits(hf, prompt))


def test_gguf_with_tokenizer_loads_and_caches_its_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []  # the slow GGUF -> tokenizer conversions transformers is asked for
    from_pretrained = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        conversions.extend([kwargs["gguf_file"]] if "gguf_file" in kwargs else [])
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(spy))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, **BYTE_LEVEL_VOCAB}))
    path = tmp_path / "tiny-chat.gguf"
    write_gguf(path, "llama", hf, "Q8_0", metadata=[byte_level_tokenizer_metadata])

    loaded = load_model(str(path))
    assert loaded.name == "tiny-chat"
    assert loaded.config.eos_token_ids == (259, 261)
    assert loaded.config.bos_token_id == 260
    assert loaded.chat_template.startswith("{% for m in messages %}")
    assert loaded.tokenizer("hell<|im_end|>").input_ids == [258, 261]
    assert conversions == ["tiny-chat.gguf"]

    again = load_model(str(path))
    assert again.tokenizer("hello<|im_start|>").input_ids == loaded.tokenizer("hello<|im_start|>").input_ids
    assert conversions == ["tiny-chat.gguf"]

    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a changed file is converted again
    load_model(str(path))
    assert conversions == ["tiny-chat.gguf"] * 2
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2  # no temp dirs left behind


def test_gguf_of_an_unknown_architecture_is_refused_with_the_supported_list(tmp_path, gguf_families):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, "falcon", gguf_families["llama"], "F32")
    with pytest.raises(ValueError) as refused:
        load_gguf_weights(str(path))
    message = str(refused.value)
    assert "\n" not in message and "'falcon'" in message
    assert all(arch in message for arch in GGUF_ARCHITECTURES)


def test_gguf_without_tokenizer_is_refused_by_load_model(tmp_path, gguf_families):
    path = tmp_path / "bare.gguf"
    write_gguf(path, "llama", gguf_families["llama"], "F32")
    with pytest.raises(ValueError, match="no tokenizer"):
        load_model(str(path))


def test_loading_a_model_does_not_import_torch_dynamo(tiny_model_dir):
    """The model is built on the meta device, where any op (a random init, the rope frequencies)
    imports torch._dynamo: 0.7 s of every server start and tensor-parallel rank, for nothing."""
    script = (
        "import sys; from atom_anyio.models.loader import load_model; load_model(sys.argv[1]);"
        "print('torch._dynamo' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_dir)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "False"


@pytest.mark.slow
def test_default_model_loads_in_seconds_and_matches_transformers(smollm2_transformers):
    start = time.perf_counter()
    loaded = load_model(None)
    assert time.perf_counter() - start < 30
    cfg = loaded.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.eos_token_ids) == (30, 576, (2,))
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    hf = smollm2_transformers
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    run = PagedRun(loaded.model, block_size=16, num_blocks=8)
    (logits,) = run.step([("a", prompt, 0)])
    assert_logits_close(logits[-1], ref.logits[0][0], tol=1e-3)
    generated = [int(logits[-1].argmax())]
    while len(generated) < 6:
        (logits,) = run.step([("a", generated[-1:], len(prompt) + len(generated) - 1)])
        generated.append(int(logits[-1].argmax()))
    assert generated == ref.sequences[0, len(prompt) :].tolist()
    assert "Paris" in loaded.tokenizer.decode(generated)
