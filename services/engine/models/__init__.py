"""Model implementations (Llama family) and the registry keyed by HF architecture name."""
