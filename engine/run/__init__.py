"""The composition root and the run around the steps: the trainer loop, the components builder, resume, preemption,
the output folder's lock and the metrics history (checkpoint files are in checkpoint/, observers in observe/)."""
