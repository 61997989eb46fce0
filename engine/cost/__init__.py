"""What a step costs against what the device could do: the work of each phase (FLOPs, decoded tokens, bytes read)
from the model's shapes and the step's counts (cost_model.py, model_shapes.py), the device's limits (a vendor peak
table, a CPU calibration: device_limits.py), the efficiency tables of `alignopsd profile --cost` (efficiency.py) and
the paper-scale step of `alignopsd plan` (step_plan.py)."""
