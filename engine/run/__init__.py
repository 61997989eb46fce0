"""The composition root and the run around the steps: the session (what a run builds once), the trainer loop, the
components builder, the warm start and the quickstart pipeline, resume, preemption, the output folder's lock and the
metrics history (checkpoint files are in checkpoint/, observers in observe/)."""
