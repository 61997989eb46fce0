"""The teacher pass of a real step reads the teacher generation's kept prompt cache
(engine/generation/prompt_cache.py)."""

from __future__ import annotations

from pathlib import Path

import learn_helpers as lh
import torch
from alignopsd.engine.step.recipe import run_step

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_step_teacher_forcing_reads_the_teacher_generations_keys_and_values(tmp_path, monkeypatch):
    """tiny.yaml with the Hugging Face generator on the CPU: the step's teacher forcing reads the cache the teacher
    generation kept, pushes only responses, and gives the log-probs of scoring the privileged prompts again."""
    torch.set_num_threads(1)
    over = [*lh.GUESS_OVERRIDES, "algorithm.estimator=alignopsd", "generation.backend=hf",
            "generation.max_response_length=6", "trainer.total_steps=1", f"output_dir={tmp_path}"]  # fmt: skip
    parts = lh.build_trainer(TINY, over).parts
    seen = []
    orig = type(parts.rescorer).teacher_logprobs

    def spy(self, batch, pairs=None, **kw):
        out = orig(self, batch, pairs, **kw)
        seen.append((kw.get("prompt_cache"), out, orig(self, batch, pairs)))
        return out

    monkeypatch.setattr(type(parts.rescorer), "teacher_logprobs", spy)
    try:
        metrics = run_step(parts, 0).metrics
    finally:
        parts.close()
    ((cache, (diag, cross, st), (diag0, cross0, st0)),) = seen
    assert cache is not None and metrics["m1/teacher_forcing_cached_prompts"] == 1
    assert st["prompt_tokens"] == 0 and 0 < st["token_forwards"] < st0["token_forwards"] - st0["prompt_tokens"] + 1
    assert metrics["m1/teacher_forcing_token_forwards"] == st["token_forwards"]
    torch.testing.assert_close(diag, diag0, atol=1e-5, rtol=0)
    torch.testing.assert_close(cross, cross0, atol=1e-5, rtol=0)
