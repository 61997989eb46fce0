"""The embedded models: causal-LM and tokenizer loading without a model hub, and the thinking encoder."""
