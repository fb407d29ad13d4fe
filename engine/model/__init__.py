"""The model side of a step: loading, the runner's forward pass, attention and its
backends, sampling, logits processors, grammars and detokenizing."""
