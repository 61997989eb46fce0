"""bench/padding_profile.py: the update's plans on a synthetic batch of the quickstart's row lengths."""

from __future__ import annotations

from alignopsd.engine.config.schema import load_config

from bench.padding_profile import measure


def test_tokens_pad_less_than_rows_and_packing_pads_nothing():
    res = measure(load_config("configs/quickstart_cpu.yaml"), rows=128, seed=0)
    fixed, tokens, packed = (res[k] for k in ("fixed rows, padded", "by tokens, padded", "by tokens, packed"))
    # the same rows: the same real positions (up to each micro-batch's last response column, which no forward pushes)
    assert tokens["real"] == packed["real"] > 0 and abs(fixed["real"] - packed["real"]) < 0.01 * packed["real"]
    assert 0.0 == packed["padding_fraction"] < tokens["padding_fraction"] < fixed["padding_fraction"]
    assert packed["computed"] == packed["real"] and tokens["micro_batches"] == packed["micro_batches"]
