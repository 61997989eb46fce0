"""Every tensor that reaches a model crosses the device boundary (``engine/parallel/devices.py``), on every
estimator's path.

On a CPU-only machine every device is "cpu", so a forgotten move cannot fail by itself. The test therefore makes
the crossing visible: ``devices.to_device`` is wrapped to return a ``Crossed`` tensor (a subclass that ops
propagate), and a forward pre-hook on the policy's module and the reference model rejects any tensor input that
is not ``Crossed``: one that came straight from the batch without passing the boundary (what a CUDA run would
meet as a device mismatch). Generation backends build their own inputs from token lists, so their calls are
exempt. Run for every estimator and ablation and both rescoring modes, one full step each.
"""

from __future__ import annotations

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.parallel import devices
from alignopsd.engine.policy.lm_head import transformer_body


class Crossed(torch.Tensor):
    """A tensor that went through the device boundary."""


class BoundaryWatch:
    def __init__(self) -> None:
        self.checked = 0
        self.bad: list[str] = []
        self.generating = False

    def hook(self, name: str):
        def pre_hook(module, args, kwargs):
            if self.generating:
                return None
            for key, value in [*enumerate(args), *kwargs.items()]:
                if isinstance(value, torch.Tensor):
                    self.checked += 1
                    if not isinstance(value, Crossed):
                        self.bad.append(f"{name}: input {key!r} did not cross the device boundary")
            return None

        return pre_hook


def _watch(tr, monkeypatch) -> BoundaryWatch:
    w = BoundaryWatch()

    def crossing(x, device):
        return None if x is None else x.to(device).as_subclass(Crossed)

    monkeypatch.setattr(devices, "to_device", crossing)
    parts = tr.parts
    models = [("policy", parts.policy.model)]
    if parts.ref_scorer is not None:
        models.append(("reference", parts.ref_scorer.model))
    for name, model in models:  # the whole model and its transformer body (the fused heads call the body)
        for mod in (model, transformer_body(model)):
            mod.register_forward_pre_hook(w.hook(name), with_kwargs=True)
    gen = parts.generator.generate

    def generate(*a, **k):
        w.generating = True
        try:
            return gen(*a, **k)
        finally:
            w.generating = False

    monkeypatch.setattr(parts.generator, "generate", generate)
    return w


def _trainer(tmp_path, overrides):
    torch.set_num_threads(1)
    ov = [*lh.GUESS_OVERRIDES, *overrides, "trainer.total_steps=1", "trainer.ppo.skip_no_signal=false",
          "algorithm.kl_coef=0.01", f"output_dir={tmp_path}"]  # fmt: skip
    return lh.build_trainer(str(lh.TINY_CONFIG), ov)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared_prefix", "plain"])
@pytest.mark.parametrize("case", [c for c, _ in lh.ESTIMATOR_CASES])
def test_every_model_input_crosses_the_boundary(case, mode, tmp_path, monkeypatch):
    from alignopsd.engine.step.recipe import run_step

    tr = _trainer(tmp_path, [*dict(lh.ESTIMATOR_CASES)[case], f"trainer.rescoring_mode={mode}"])
    w = _watch(tr, monkeypatch)
    out = run_step(tr.parts, 0)
    tr.parts.close()
    assert lh.no_region_errors(out.metrics)
    assert w.checked > 0 and not w.bad, w.bad[:5]
    assert out.metrics["update/optimizer_steps"] >= 1


def test_the_watch_sees_a_bypassed_boundary(tmp_path, monkeypatch):
    """Negative control: a scorer that hands the batch to the model without the boundary is caught."""
    from alignopsd.engine.step.recipe import run_step

    tr = _trainer(tmp_path, ["algorithm.estimator=grpo"])
    w = _watch(tr, monkeypatch)
    monkeypatch.setattr(devices, "to_device", lambda x, device: x)  # a boundary that forgets to move
    run_step(tr.parts, 0)
    tr.parts.close()
    assert any("policy" in b for b in w.bad)
