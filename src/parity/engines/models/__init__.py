"""Causal language models, in three modules: `config` (Hugging Face's config.json as a checked
`ModelConfig`), `modules` (the decoder transformer, `CausalLM`) and `io` (model directories: resolving,
loading and saving safetensors weights). Each name is imported from the module that defines it."""
