"""The ``alignopsd`` command line: train, eval, sft and the quickstart pipeline, compare, profile."""
