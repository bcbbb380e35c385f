"""transformers 5.25's text config defaults, for the vision-language wrappers.

A wrapper's ``text_config`` names only some keys (LLaVA 1.5's five, Gemma 3 4B's
six); transformers fills the rest from the text config class's defaults, and so
does `entrenar.nn.multimodal.text_config` with these tables (each checked against
its class by tests/io/test_hf_multimodal.py).
"""

from __future__ import annotations

from typing import Any

LLAMA_TEXT: dict[str, Any] = {  # LlamaConfig's (LLaVA 1.5's text_config: 5 keys)
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
}
MISTRAL_TEXT: dict[str, Any] = {
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
    "initializer_range": 0.02,
}
QWEN2_TEXT: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "initializer_range": 0.02,
}
GEMMA3_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "initializer_range": 0.02,
}
MINISTRAL3_TEXT: dict[str, Any] = {  # Ministral3Config's (its rope: the family's)
    "model_type": "ministral3",
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 34,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "initializer_range": 0.02,
}
MISTRAL_SMALL: dict[str, Any] = {  # Mistral3Config's text_config when none is given
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "vocab_size": 131072,
}
QWEN2_VL_TEXT: dict[str, Any] = {  # Qwen2VLTextConfig's = Qwen2_5_VLTextConfig's
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "use_sliding_window": False,
    "max_window_layers": 80,
    "initializer_range": 0.02,
}
QWEN3_VL_TEXT: dict[str, Any] = {
    "model_type": "qwen3_vl_text",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "initializer_range": 0.02,
}
QWEN3_VL_MOE_TEXT: dict[str, Any] = {  # its num_experts: "num_local_experts" too
    "model_type": "qwen3_vl_moe_text",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "initializer_range": 0.02,
}
QWEN2_VL_FLAT = (  # Qwen2VLTextConfig's fields, and the rope keys transformers adds
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
    "attention_dropout", "rope_parameters", "bos_token_id", "eos_token_id",
    "pad_token_id", "rope_scaling", "rope_theta",
)  # fmt: skip

__all__ = [
    "GEMMA3_TEXT",
    "LLAMA_TEXT",
    "MINISTRAL3_TEXT",
    "MISTRAL_SMALL",
    "MISTRAL_TEXT",
    "QWEN2_TEXT",
    "QWEN2_VL_FLAT",
    "QWEN2_VL_TEXT",
    "QWEN3_VL_MOE_TEXT",
    "QWEN3_VL_TEXT",
]
