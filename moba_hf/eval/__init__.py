"""Long-context evaluation: passkey, needle-in-a-haystack, perplexity, lm-eval tasks."""
