"""Layers and models as pure functions over parameter pytrees.

Protocol: a model is a frozen config dataclass with ``init(key) -> params`` and a pure
``apply(params, inputs, ...) -> outputs``; params are nested dicts named like Hugging
Face modules, transformer layers stacked along a leading axis and run with
`jax.lax.scan`. Every layer multiplies through `linear`, which dispatches on the
weight's node type (array, LoRA, quantized, bfloat16-stored), so model code never
touches weights. Every weight answers the weight-node protocol (`logical_shape`,
`logical_dtype`, `to_dense`, `nbytes`, `is_weight_node`), which each node type
registers in its own package.
"""

from entrenar.nn import (  # families register
    arcee,
    cohere,
    deepseek,
    ernie,
    exaone,
    gemma,
    glm,
    glm4_moe,
    gpt_oss,
    granite,
    granitemoe,
    losses,
    mistral,
    moe,
    moe_families,
    olmo,
    olmoe,
    phi3,
    qwen,
    seed_oss,
    smollm3,
)
from entrenar.nn.attention import (
    KVCache,
    causal_mask,
    dot_product_attention,
    init_kv_cache,
    update_cache_layer,
)
from entrenar.nn.bf16_weight import Bfloat16Weight, TiedEmbedding, to_bfloat16_weights
from entrenar.nn.generate import (
    StepLogprobs,
    check_length,
    context_length,
    decode_step,
    generate,
    generate_stream,
    sample_logits,
)
from entrenar.nn.gpt2 import GPT2, GPT2Config, conv1d_transpose
from entrenar.nn.hf_names import STACKED_KEYS, from_hf_names, to_hf_names
from entrenar.nn.init import (
    fans,
    kaiming_normal,
    kaiming_uniform,
    normal,
    xavier_normal,
    xavier_uniform,
)
from entrenar.nn.layers import (
    dropout,
    embedding,
    gated_mlp,
    gelu_tanh,
    layer_norm,
    mlp,
    rms_norm,
    silu,
)
from entrenar.nn.linear import (
    MATMUL_DTYPES,
    auto_matmul_dtype,
    linear,
    lowp_matmul,
    weight_matmul,
)
from entrenar.nn.llama import Llama, LlamaConfig
from entrenar.nn.losses import causal_lm_loss, cross_entropy, kl_divergence
from entrenar.nn.mlp_model import MLP
from entrenar.nn.registry import (
    Architecture,
    architecture,
    architecture_for_gguf,
    architecture_for_hf,
    architecture_names,
    architecture_of,
    architectures,
    register_architecture,
)
from entrenar.nn.rope import apply_rope, rope_angles, rope_tables, rotate, rotate_half
from entrenar.nn.scoring import TokenLogprobs, token_logprobs
from entrenar.nn.weight_node import (
    is_weight_node,
    logical_dtype,
    logical_shape,
    nbytes,
    register_weight_node,
    to_dense,
)

__all__ = [
    "GPT2",
    "MATMUL_DTYPES",
    "MLP",
    "STACKED_KEYS",
    "Architecture",
    "Bfloat16Weight",
    "GPT2Config",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "StepLogprobs",
    "TiedEmbedding",
    "TokenLogprobs",
    "apply_rope",
    "arcee",
    "architecture",
    "architecture_for_gguf",
    "architecture_for_hf",
    "architecture_names",
    "architecture_of",
    "architectures",
    "auto_matmul_dtype",
    "causal_lm_loss",
    "causal_mask",
    "check_length",
    "cohere",
    "context_length",
    "conv1d_transpose",
    "cross_entropy",
    "decode_step",
    "deepseek",
    "dot_product_attention",
    "dropout",
    "embedding",
    "ernie",
    "exaone",
    "fans",
    "from_hf_names",
    "gated_mlp",
    "gelu_tanh",
    "gemma",
    "generate",
    "generate_stream",
    "glm",
    "glm4_moe",
    "gpt_oss",
    "granite",
    "granitemoe",
    "init_kv_cache",
    "is_weight_node",
    "kaiming_normal",
    "kaiming_uniform",
    "kl_divergence",
    "layer_norm",
    "linear",
    "logical_dtype",
    "logical_shape",
    "losses",
    "lowp_matmul",
    "mistral",
    "mlp",
    "moe",
    "moe_families",
    "nbytes",
    "normal",
    "olmo",
    "olmoe",
    "phi3",
    "qwen",
    "register_architecture",
    "register_weight_node",
    "rms_norm",
    "rope_angles",
    "rope_tables",
    "rotate",
    "rotate_half",
    "sample_logits",
    "seed_oss",
    "silu",
    "smollm3",
    "to_bfloat16_weights",
    "to_dense",
    "to_hf_names",
    "token_logprobs",
    "update_cache_layer",
    "weight_matmul",
    "xavier_normal",
    "xavier_uniform",
]
