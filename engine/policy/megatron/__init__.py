"""Megatron-core tensor-parallel policy backend."""
