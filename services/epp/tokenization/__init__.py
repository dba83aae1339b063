"""In-process tokenization: the model's tokenizer and chat template, as vLLM 0.32 applies them."""
