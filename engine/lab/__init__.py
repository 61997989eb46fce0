"""What a step and a run cost, measured and estimated, for the commands that say it (nothing a training run imports):
the work of each phase (FLOPs, decoded tokens, bytes read) from the model's shapes and the step's counts
(cost_model.py; the shapes are models/shapes.py), the device's limits (a vendor peak table, a CPU calibration:
device_limits.py), the short calibration on the run's own code paths and the rates it fits (calibration.py,
calibrated.py), the efficiency tables of `alignopsd profile --cost` (efficiency.py), the paper-scale step of
`alignopsd plan` (step_plan.py, with the padding its forwards compute: padding_plan.py), the quickstart pipeline's
time estimate (estimate.py) and the Megatron backend's per-rank memory report of `alignopsd memory`
(megatron_memory.py)."""
