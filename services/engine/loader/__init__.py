"""Weight loading: Hugging Face safetensors directories, and random weights of named shapes."""
