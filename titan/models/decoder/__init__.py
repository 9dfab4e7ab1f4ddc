"""The parts every decoder-only family composes: its args and their bounds (args.py), attention (attention.py), RoPE
(rope.py), the KV cache (kv_cache.py), the block with the family's feed-forward and the stack of blocks (model.py),
the dense tensor-parallel plan and the pipeline split (parallelize.py), and the Hugging Face conversion's shared part
(hf.py). A family (titan/models/llama/, titan/models/moe/) imports these, never another family."""
