"""What a run costs and how fast it goes: the work of each phase of a step, the device's limits, and the plans
and efficiency tables built from them (engine/observe/cost_model.py, device_limits.py, efficiency.py)."""
