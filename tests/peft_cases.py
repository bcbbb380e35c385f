"""The tiny Llama the PEFT/transformers parity tests build on both sides."""

from entrenar.nn import LlamaConfig

CFG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
)
