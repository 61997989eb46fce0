"""Processes and devices: data-parallel collectives, the tensor-parallel group broadcast and the device boundary."""
