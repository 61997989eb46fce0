"""What a run tells about itself: metrics files and the loggers they fan out to (TensorBoard, W&B, MLflow), the step
profiler (and the CUDA host-sync counter), progress lines, audit records, the end-of-run report rendered from the
metrics, and strict mode for the diagnostics that keep a run alive."""
