"""Token layout shared by the policy backends, the generation backends and the step: positions from attention masks,
left/right padding of token rows, truncation; the tokenizer's contract (what the engine reads of a tokenizer) and its
end and pad ids (one rule, special.py)."""
