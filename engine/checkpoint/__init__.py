"""Files a run writes and trusts: checkpoints (atomic, verified, resumable), their manifest of sizes and checksums,
the safetensors weight writer, tensor + JSON state files, the trainer state and the safe reading of sharded (DCP)
checkpoints."""
