"""The ``alignopsd`` command line: train, eval, sft and the quickstart pipeline, compare, profile; and
``python -m alignopsd.engine.commands.cpu_profile`` (``make run-avx2``)."""
