"""Optional integrations with other libraries; each submodule imports its library only when used.

- `tilelang_ops.integrations.hf`: ``attn_implementation="tileops"`` for Hugging Face transformers.
"""
