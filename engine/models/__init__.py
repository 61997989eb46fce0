"""The embedded models: causal-LM and tokenizer loading without a model hub, the thinking encoder, and the shapes of
a decoder-only transformer that its cost and its activations' memory depend on (shapes.py)."""
