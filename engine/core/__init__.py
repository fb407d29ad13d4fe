"""The batching loop: requests, the scheduler, KV block bookkeeping, the engine and its
async wrapper, the outputs and the step log."""
