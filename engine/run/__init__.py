"""The run around the steps: the trainer loop, the composition root, checkpoints and their manifest, resume,
metrics, audit records, the end-of-run report and the step profiler."""
