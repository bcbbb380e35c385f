"""How each `LlamaConfig` family is laid out in a llama.cpp GGUF file.

llama.cpp names a model's family in ``general.architecture`` (`entrenar.nn`'s
registry maps it to a family: `entrenar.nn.architecture_for_gguf`) and its
hyperparameters ``{arch}.*``. The families differ in:

- **the name written**: a family's ``gguf_name``; Mistral, which llama.cpp converts
  as a Llama, is written as ``llama`` (`WRITTEN_AS`) and told apart on reading by
  the ``entrenar.family`` key (below); OLMo 3 is written as ``olmo2`` and told
  apart by its sliding layers (`WINDOWED`);
- **q/k rows**: permuted for llama.cpp's interleaved rotary only in the families
  llama.cpp converts with the permutation (`PERMUTED`: ``llama``, ``smollm3``,
  ``granite``, ``arcee``);
  Qwen2/3, Gemma and Phi-3 use NEOX (half-split) rotary, as Hugging Face does;
  GLM-4's interleaved pairs are llama.cpp's own (NORM) layout, kept as they are;
- **Granite's multipliers** (`SCALE_KEYS`): ``embedding_scale``,
  ``residual_scale``, ``attention.scale``, ``logit_scale``;
- **partial rotary** (`PARTIAL_ROTARY`): ``rope.dimension_count`` below the head
  dimension rotates the first values of each head in llama.cpp's Phi-3 graph; the
  others assert it equals the head dimension;
- **NoPE layers** (`NOPE_PERIOD`): SmolLM3's graph skips rotary on every 4th layer,
  a rule no key states;
- **biases a graph does not load** (`UNBIASED`): Seed-OSS's o_proj and MLP
  biases, ERNIE 4.5's MLP biases (a config with them is refused);
- **ERNIE 4.5's interleaved pairs** (``rope_interleave``, implied by ``ernie4_5``):
  llama.cpp's NORM rotary turns the same pairs, so its q/k rows are written
  unpermuted; other names refuse ``rope_interleave``;
- **Arcee's MLP** (implied by ``arcee``): ``ffn_up`` and ``ffn_down`` with no
  ``ffn_gate`` is its ungated squared-ReLU MLP there (Phi-3's fused ``gate_up``
  elsewhere); other names refuse ``ungated_mlp``;
- **norm weights**: llama.cpp's Gemma converters store ``1 + w`` for every RMSNorm
  weight (`NORM_SHIFT`), entrenar keeps Hugging Face's ``w``;
- **what is implied** by the name (`IMPLIED`): Gemma's GeGLU, ``(1 + w)`` norms,
  sandwich norms (Gemma 2/3), ``√D`` embedding scale and tied head (`TIED`: Gemma
  1's graph has no ``output`` tensor); OLMo 2's output norms and whole-row q/k
  norms, and its untied head (`UNTIED`);
- **tensor names** (`LAYER_STEMS`): Hugging Face module -> ``blk.N.<stem>``, with
  Gemma's four norms (`SANDWICH_STEMS`), GLM-4's (`GLM_STEMS`), OLMo 2's two
  (`POST_NORM_STEMS`), gpt-oss's and Seed-OSS's ``post_attention_norm``
  (`FAMILY_STEMS`), gpt-oss's sinks
  (``blk.N.attn_sinks.weight``, `LEAF_NAMES`), and Phi-3's fused
  ``attn_qkv``/``ffn_up``;
- **Cohere** (``command-r``, ``cohere2``: src/models/command-r.cpp, cohere2.cpp):
  the name implies LayerNorms without bias (``attention.layer_norm_epsilon``,
  `LAYER_NORM_EPS`), parallel layers, llama.cpp's NORM rotary on Hugging Face's
  unpermuted rows (Cohere's pairs are interleaved already) and a tied head;
  ``logit_scale`` *multiplies* the logits (`LOGIT_SCALE`; Granite's divides);
  command-r's per-head q/k norms ``attn_q_norm {d, H}`` exist exactly when the
  model has 64 layers or more (`QK_NORM_LAYERS`), cohere2 rotates only its sliding
  layers (`NOPE_FULL`; the layout is ``attention.sliding_window_pattern``);
- **OLMoE** (``olmoe``, src/models/olmoe.cpp): OLMo 2's whole-row q/k norms before
  the mixture (pre-norm layers, not OLMo 2's post norms), experts
  ``feed_forward_length`` wide, top-k weights never renormalised; its graph has no
  ``attn_output`` bias and no q/k/v clipping (`IMPLIED`: a config with either is
  refused on writing);
- **Granite MoE** (``granitemoe``, src/models/granite.cpp's graph): Granite's
  multipliers and permuted q/k, experts ``feed_forward_length`` wide, top-k
  renormalised; Granite MoE shared is written under the same name with
  ``expert_shared_feed_forward_length`` and ``ffn_{gate,up,down}_shexp``
  (`SHARED_MLP`), its fused ``shared_mlp.input_linear`` ``[gate; up]`` split into
  two tensors (`SPLIT_STEMS`);
- **EXAONE 4.0** (``exaone4``, src/models/exaone4.cpp): OLMo 2's output norms
  (implied) with per-head q/k norms, NEOX rotary on Hugging Face's rows; sliding
  layers only at 64 layers (`SWA_LAYERS`), where the global ones are NoPE; at any
  other count every layer attends fully and rotates (a config with a window or
  NoPE layers there is refused);
- **Ministral 3** (``mistral3``, src/models/mistral3.cpp): Llama's permuted q/k,
  Llama 4's query scale (`TEMPERATURE`), YaRN's ``yarn_log_multiplier``
  (`YARN_LOG_MUL`), no sliding window (`NO_WINDOW`);
- **gpt-oss** (``gpt-oss``, src/models/openai-moe.cpp): its graph fixes the clamped
  SwiGLU (limit 7, ``α`` 1.702), the biased experts, the sinks and the layers
  alternating sliding / full (`IMPLIED`, `SWA_PATTERN`), and rounds YaRN's
  correction range (ggml's ``ggml_rope_yarn_corr_dims`` floors and ceils): a file
  without ``entrenar.family`` reads with ``rope_truncate=True``, as llama.cpp runs
  it, where transformers' gpt-oss keeps the range fractional.

The writer also stores every switch that differs from Llama's default in
``entrenar.family``, a JSON object of `LlamaConfig` fields (`SWITCH_FIELDS`) that
llama.cpp ignores and the reader applies last: it carries what llama.cpp's metadata
cannot state (dynamic NTK rotary, llama3's parameters behind ``rope_freqs``, the
layer types of Qwen2 and Mistral, Gemma's query scale where llama.cpp derives
another), so a file entrenar wrote reads back as the same config.
"""

from __future__ import annotations

from typing import Any

from entrenar.nn.decoder_config import ROPE_KEYS, SWITCHES

GLOBAL_STEMS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
"""Hugging Face module outside the layers -> GGUF tensor stem."""
LAYER_STEMS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "shared_mlp.output_linear": "ffn_down_shexp",
}
"""Hugging Face module of a layer -> GGUF stem (``blk.N.<stem>.weight``/``.bias``).

A mixture of experts (`entrenar.nn.moe`): the router ``ffn_gate_inp (E, D)``, each
projection's experts as one tensor ``ffn_{gate,up,down}_exps (E, out, in)`` (ggml's
``ne = {in, out, E}``, llama-arch.cpp; the tree's ``(L, E, out, in)`` leaf a layer at
a time) and Qwen2-MoE's shared expert ``ffn_*_shexp`` with its gate
``ffn_gate_inp_shexp (1, D)`` (llama.cpp's ``{n_embd}``)."""
SANDWICH_STEMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
"""Gemma 2/3's norms (``sandwich_norms``), replacing `LAYER_STEMS`' entries."""
POST_NORM_STEMS = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
"""OLMo 2's norms on the sublayer outputs (``post_norms``), replacing
`LAYER_STEMS`' entries."""

SPLIT_STEMS = {"shared_mlp.input_linear": ("ffn_gate_shexp", "ffn_up_shexp")}
"""Layer modules stored fused in the tree and as row halves in GGUF: Granite MoE
shared's ``shared_mlp.input_linear (L, 2S, D)`` is ``[gate; up]``, llama.cpp's
``ffn_gate_shexp`` and ``ffn_up_shexp`` ``(S, D)`` each (its converter splits it)."""
GLM_STEMS = {
    "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "post_mlp_layernorm": "post_ffw_norm",
}
"""GLM-4's norms (``glm_norms``), replacing `LAYER_STEMS`' entries: llama.cpp's
``attn_post_norm``, ``ffn_norm`` and ``ffn_post_norm`` (src/models/glm4.cpp)."""

FAMILY_STEMS = {
    "gpt_oss": {"post_attention_layernorm": "post_attention_norm"},
    "seed_oss": {"post_attention_layernorm": "post_attention_norm"},
}
"""Per family (`LlamaConfig.architecture`), stems replacing `LAYER_STEMS`' entries."""
LEAF_NAMES = {"self_attn.sinks": ("attn_sinks", "weight")}
"""Layer leaves that are not a module's ``weight``/``bias`` -> (stem, suffix)."""

WRITTEN_AS = {
    "mistral": "llama",
    "mixtral": "llama",
    "olmo3": "olmo2",
    "granitemoeshared": "granitemoe",
    "deepseek_v2": "deepseek2",  # told apart by its softmax gating
}
"""Families without a llama.cpp name of their own, and the name they are written as."""
PERMUTED = frozenset({"llama", "smollm3", "granite", "granitemoe", "arcee", "mistral3"})
"""llama.cpp names whose q/k rows are permuted (interleaved rotary)."""
NORM_SHIFT = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0}
"""llama.cpp names whose norm weights are stored plus this."""
IMPLIED: dict[str, dict[str, Any]] = {
    name: {
        "hidden_act": "gelu_pytorch_tanh",
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "scale_embeddings": True,
    }
    for name in ("gemma2", "gemma3")
}
IMPLIED["olmo2"] = {"post_norms": True, "qk_norm_whole": True}
IMPLIED["olmoe"] = {
    "qk_norm": True,
    "qk_norm_whole": True,
    "attention_out_bias": False,  # olmoe.cpp: build_attn(wo, NULL)
    "clip_qkv": None,  # olmoe.cpp reads no attention.clamp_kqv
}
IMPLIED["glm4"] = {"glm_norms": True, "rope_interleave": True}  # LLAMA_ROPE_TYPE_NORM
IMPLIED["gpt-oss"] = {
    "attention_sinks": True,
    "moe_bias": True,
    "swiglu_limit": 7.0,
    "swiglu_alpha": 1.702,
}  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: alpha and limit are constants
IMPLIED["exaone4"] = {"post_norms": True, "qk_norm_whole": False}  # per-head q/k
IMPLIED["ernie4_5"] = {"rope_interleave": True}  # NORM rotary, rows as HF's
IMPLIED["arcee"] = {"ungated_mlp": True, "hidden_act": "relu2"}  # LLM_FFN_RELU_SQR
IMPLIED["gemma"] = {
    k: v for k, v in IMPLIED["gemma2"].items() if k != "sandwich_norms"
}  # Gemma 1: Llama's two norms a layer
IMPLIED["command-r"] = IMPLIED["cohere2"] = {
    "layer_norm": True,
    "parallel_residual": True,
    "rope_interleave": True,
}  # entrenar.nn.cohere.COHERE
"""`LlamaConfig` fields a llama.cpp name implies."""
UNBIASED = {
    "seed_oss": ("attention_out_bias", "mlp_bias"),
    "ernie4_5": ("mlp_bias",),
    "arcee": ("attention_out_bias", "mlp_bias"),
}
"""llama.cpp names whose graph loads none of these biases (src/models/seed-oss.cpp:
q/k/v biases only; ernie4-5.cpp: q/k/v/o; arcee.cpp: q/k/v)."""
TIED = frozenset({"gemma", "command-r", "cohere2"})
"""llama.cpp names whose graph has no ``output.weight``: the head is the table."""
UNTIED = frozenset({"olmo2"})
"""llama.cpp names whose graph needs ``output.weight`` (no tied head)."""
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "olmo2": 4, "gpt-oss": 2, "cohere2": 4}
"""llama.cpp's default sliding-layer period: layer ``i`` slides unless ``(i + 1) % n
== 0`` (as Hugging Face's Gemma configs lay them out)."""
PARTIAL_ROTARY = frozenset({"phi3", "glm4"})
"""llama.cpp names whose graph rotates ``rope.dimension_count`` values of each head
and passes the rest (Phi-4-mini: 96 of 128, NEOX layout as Hugging Face's; GLM-4:
half of each head in adjacent pairs, llama.cpp's NORM rotary, which is Hugging
Face's interleaved GLM layout, so its q/k rows are not permuted); the other graphs
entrenar writes assert ``n_rot == n_embd_head`` (llama.cpp's
``src/models/llama.cpp``)."""
SWA_LAYERS = {"exaone4": (64, 4)}
"""llama.cpp names whose graph has sliding layers only at one layer count -> (that
count, the default sliding period): EXAONE 4.0 32B's 64 (src/models/exaone4.cpp).
There ``attention.sliding_window`` (default 4096) and
``attention.sliding_window_pattern`` (booleans, or a period: default 4) lay them out
and only the sliding layers rotate (the global ones are NoPE, as in transformers'
EXAONE 4 with a window); at any other count llama.cpp ignores both keys and every
layer attends fully and rotates (EXAONE 4.0 1.2B, ``sliding_window`` null)."""
NOPE_PERIOD = {"smollm3": 4}
"""llama.cpp names whose graph skips rotary on layer ``i`` when ``(i + 1) % n == 0``
(no key states it: SmolLM3's ``n_no_rope_layer_step``, fixed at 4)."""
NOPE_FULL = frozenset({"cohere2"})
"""llama.cpp names whose graph rotates the sliding layers only: every
full-attention layer is NoPE (`LlamaConfig.nope_layers`, derived from the layout)."""
TEMPERATURE = frozenset({"mistral3"})
"""llama.cpp names whose graph multiplies each query after rotary by Llama 4's
``1 + β ln(1 + ⌊p / L⌋)`` (`LlamaConfig.query_scale_beta`, ``query_scale_length``):
``β`` is ``attention.temperature_scale``, ``L`` llama.cpp's ``n_ctx_orig_yarn``
(``rope.scaling.original_context_length``, default ``context_length``;
src/models/mistral3.cpp, llm_graph_input_attn_temp)."""
YARN_LOG_MUL = frozenset({"mistral3"})
"""llama.cpp names that read ``rope.scaling.yarn_log_multiplier`` ``m`` (the
converter writes Ministral 3's ``mscale_all_dim``): llama.cpp then scales yarn's cos
and sin by ``attn_factor · yarn_mscale(s) / (0.1 m ln s + 1)`` (llama-context.cpp,
``mscale`` taken as 1), not ``attn_factor · yarn_mscale(s)``."""
NO_WINDOW = frozenset({"mistral3"})
"""llama.cpp names whose graph has no sliding window (a config with one is
refused)."""
LOGIT_SCALE = frozenset({"command-r", "cohere2"})
"""llama.cpp names whose ``logit_scale`` multiplies the logits
(`LlamaConfig.logit_scale`); Granite's (`SCALE_KEYS`) divides them."""
LAYER_NORM_EPS = "attention.layer_norm_epsilon"
"""The ``ε`` key of a model whose norms are LayerNorms (`LlamaConfig.layer_norm`;
RMSNorm's is ``attention.layer_norm_rms_epsilon``)."""
SCALING_NONE = frozenset({"command-r", "cohere2"})
"""llama.cpp names whose converter writes ``rope.scaling.type`` ``none`` for
unscaled rotary (entrenar writes it too, so the keys are the converter's)."""
HEAD_KEYS = frozenset({"cohere2", "exaone4"})
"""llama.cpp names whose converter writes ``attention.key_length`` and
``value_length`` always (transformers' Cohere2Config and Exaone4Config set
``head_dim``); entrenar writes them too, elsewhere only for ``d != D / H``."""
SQUARE_ATTENTION = frozenset({"command-r", "cohere2", "exaone4"})
"""llama.cpp names whose graph takes ``attn_output`` as ``{D, D}``: the heads must
fill the width (``H d = D``)."""
QK_NORM_LAYERS = {"command-r": 64}
"""llama.cpp names whose graph loads per-head q/k norms (``attn_q_norm {d, H}``,
`LlamaConfig.qk_norm_heads`) exactly when the model has at least this many layers
(Command-R+'s 64: src/models/command-r.cpp)."""
WHOLE_HEADS = frozenset({"olmoe"})
"""llama.cpp names whose heads are ``embedding_length / head_count`` wide and whose
keys have every head (olmoe.cpp sizes ``attn_q`` ``{n_embd, n_embd}`` and
``attn_k_norm`` ``{n_embd}``: no grouped-query attention, as OLMoE-1B-7B has none):
read with ``head_dim`` None, as the family's ``config.json`` reader makes it; a
config with other heads, or fewer KV heads, is refused."""
SHARED_MLP = {"granitemoe": "granitemoeshared"}
"""llama.cpp names that hold two families: the one a file with
``expert_shared_feed_forward_length`` > 0 is (Granite MoE shared's ungated
``shared_mlp``, `entrenar.nn.LlamaConfig.shared_mlp_intermediate_size`)."""
WINDOWED = {"olmo2": "olmo3"}
"""llama.cpp names that hold two families: the one a file with sliding layers is
(llama.cpp's olmo2 runs OLMo 3, whose sliding layers rotate unscaled at
``rope.freq_base_swa``, default ``rope.freq_base``)."""
UNSCALED = {"mistral3": "mistral"}
"""llama.cpp names that hold two families: the one a file without
``attention.temperature_scale`` is (llama.cpp's converter writes Mistral Small
3.1/3.2's language model as ``mistral3`` too, without Ministral 3's query scale; a
file entrenar wrote names its family in ``entrenar.family``)."""
ONE_BASE = frozenset({"olmo2"})
"""llama.cpp names whose graph rotates the sliding layers at ``rope.freq_base``
(0.3.36's olmo2 reads ``rope.freq_base_swa`` but does not use it)."""
SCALE_KEYS = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention.scale",
    "logits_scaling": "logit_scale",
}
"""Granite's multipliers -> llama.cpp's ``{arch}.*`` keys (its converter's names)."""
SCALED = frozenset({"granite", "granitemoe"})
"""llama.cpp names whose graph reads `SCALE_KEYS` (``logit_scale`` required)."""
MOE_FAMILIES = {
    "llama": "mixtral",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "gpt-oss": "gpt_oss",
    "olmoe": "olmoe",
    "granitemoe": "granitemoe",
}
"""llama.cpp names that read experts (``{arch}.expert_count > 0``) -> the family: a
``llama`` file with experts is a Mixtral (llama.cpp's converter writes Mixtral so)."""
EXPERT_NORM = {
    "llama": True,
    "qwen3moe": True,
    "qwen2moe": False,
    "gpt-oss": True,
    "olmoe": False,
    "granitemoe": True,
}
"""Whether llama.cpp renormalises the top-k routing weights of each name: fixed per
architecture in its graphs (``build_moe_ffn``'s ``norm_w``: src/models/llama.cpp,
qwen3moe.cpp, granite.cpp true, qwen2moe.cpp, olmoe.cpp false), whatever
``expert_weights_norm`` says (these do not read it; gpt-oss's softmax over the top-k
logits, ``SOFTMAX_WEIGHT``, is the renormalised one). A config routing otherwise has no
llama.cpp form."""
FF_EXPERTS = frozenset({"llama", "olmoe", "granitemoe"})
"""llama.cpp names whose experts are ``feed_forward_length`` wide (their graphs
size ``ffn_*_exps`` by ``n_ff``; the converter writes no
``expert_feed_forward_length``): Mixtral, OLMoE and Granite MoE, whose configs
have no ``moe_intermediate_size``."""
ONE_WIDTH = frozenset({"gpt-oss"})
"""llama.cpp names whose every MLP is an expert ``expert_feed_forward_length`` wide:
the config's ``intermediate_size`` (no ``moe_intermediate_size``), as gpt-oss's
config.json has it."""
SHARED_EXPERT = frozenset({"qwen2moe"})
"""llama.cpp names whose MoE layers have (and must have) a shared expert."""
F32_STEMS = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp"})
"""Matrices llama.cpp keeps in F32 whatever the file's type: the routers (its
converter's rule for FFN_GATE_INP(_SHEXP), and llama-quant.cpp never quantizes
``ffn_gate_inp``)."""
FAMILY_KEY = "entrenar.family"
"""GGUF key of the JSON object of fields llama.cpp's keys cannot state."""
_TOLD_BY_TENSORS = frozenset(
    "attention_bias attention_out_bias mlp_bias qk_norm fused_qkv fused_gate_up "
    "num_experts shared_expert_intermediate_size partial_rotary_factor".split()
)  # (the experts' sizes: {arch}.expert_count, expert_shared_feed_forward_length;
# the rotated share: rope.dimension_count)
SWITCH_FIELDS = (
    "architecture",
    "rope_type",
    *ROPE_KEYS.values(),  # the rope type's parameters
    *(s for s in SWITCHES if s != "rope_type" and s not in _TOLD_BY_TENSORS),
    "rope_truncate",
    "swiglu_alpha",
)
"""`LlamaConfig` fields ``entrenar.family`` may hold (nothing else is read from it):
the switches not told by the tensor table (biases, q/k norms and fused weights are)
or the expert keys."""


def written_name(family: str, gguf_name: str | None) -> str | None:
    """The ``general.architecture`` a family is written under (None: no GGUF form)."""
    return gguf_name or WRITTEN_AS.get(family)


def layer_stems(config: Any) -> dict[str, str]:
    """`LAYER_STEMS` for ``config``, with its norms' stems.

    Gemma's `SANDWICH_STEMS`, OLMo 2's `POST_NORM_STEMS` or GLM-4's `GLM_STEMS`
    when it has them, its family's `FAMILY_STEMS` (gpt-oss).
    """
    family = getattr(config, "architecture", "")
    stems = dict(LAYER_STEMS) | FAMILY_STEMS.get(family, {})
    if getattr(config, "sandwich_norms", False):
        stems |= SANDWICH_STEMS
    if getattr(config, "post_norms", False):
        stems |= POST_NORM_STEMS
    if getattr(config, "glm_norms", False):
        stems |= GLM_STEMS
    return stems


def gguf_names(config: Any) -> dict[str, str]:
    """Hugging Face tensor name (layer ``N`` as ``layers.N``) -> GGUF tensor name.

    Every leaf of ``config.param_shapes()`` gets a name, but those stored as two
    tensors (`SPLIT_STEMS`, `split_names`); the layer names are given for every
    layer.

    Raises:
        KeyError: a module with no GGUF name (a family this table lacks).
    """
    return _names(config)[0]


def split_names(config: Any) -> dict[str, tuple[str, str]]:
    """Hugging Face name -> the GGUF names of its two row halves (`SPLIT_STEMS`)."""
    return _names(config)[1]


def _names(config: Any) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """`gguf_names` and `split_names` of ``config``."""
    stems = layer_stems(config)
    out: dict[str, str] = {}
    split: dict[str, tuple[str, str]] = {}

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for key, sub in tree.items():
            path = f"{prefix}{key}"
            if isinstance(sub, dict):
                walk(sub, f"{path}.")
                continue
            module, _, kind = path.rpartition(".")
            leaf = LEAF_NAMES.get(path.removeprefix("model.layers."))
            if leaf is not None:  # gpt-oss's sinks: blk.N.attn_sinks.weight
                for i in range(config.num_layers):
                    hf = f"model.layers.{i}.{path.removeprefix('model.layers.')}"
                    out[hf] = f"blk.{i}.{leaf[0]}.{leaf[1]}"
                continue
            halves = SPLIT_STEMS.get(module.removeprefix("model.layers."))
            if halves is not None:  # Granite MoE shared's [gate; up]
                for i in range(config.num_layers):
                    hf = f"model.layers.{i}.{module.removeprefix('model.layers.')}"
                    a, b = (f"blk.{i}.{h}.{kind}" for h in halves)
                    split[f"{hf}.{kind}"] = (a, b)
                continue
            if module.startswith("model.layers."):
                stem = stems[module.removeprefix("model.layers.")]
                for i in range(config.num_layers):
                    hf = f"model.layers.{i}.{module.removeprefix('model.layers.')}"
                    out[f"{hf}.{kind}"] = f"blk.{i}.{stem}.{kind}"
            else:
                out[path] = f"{GLOBAL_STEMS[module]}.{kind}"

    walk(config.param_shapes(), "")
    return out, split


def default_nope_layers(name: str, n_layers: int) -> tuple[bool, ...] | None:
    """The NoPE layers llama.cpp's graph assumes for ``name`` (None: none)."""
    n = NOPE_PERIOD.get(name)
    nope = tuple(n is not None and (i + 1) % n == 0 for i in range(n_layers))
    return nope if any(nope) else None


def full_layers_nope(
    name: str, layer_types: tuple[str, ...] | None, n_layers: int
) -> tuple[bool, ...] | None:
    """`NOPE_FULL`'s NoPE layers: the full-attention ones (None: none).

    ``layer_types`` None: every layer attends fully.
    """
    if name not in NOPE_FULL:
        return None
    nope = tuple(t != "sliding_attention" for t in layer_types or ("",) * n_layers)
    return nope if any(nope) else None


def default_layer_types(name: str, n_layers: int) -> tuple[str, ...] | None:
    """The layer types llama.cpp assumes for ``name`` (None: no sliding layers)."""
    n = SWA_PATTERN.get(name)
    count, period = SWA_LAYERS.get(name, (None, None))
    if count == n_layers:
        n = period
    if n is None:
        return None
    return tuple(
        "full_attention" if (i + 1) % n == 0 else "sliding_attention"
        for i in range(n_layers)
    )


__all__ = [
    "EXPERT_NORM",
    "F32_STEMS",
    "FAMILY_KEY",
    "FAMILY_STEMS",
    "FF_EXPERTS",
    "GLM_STEMS",
    "GLOBAL_STEMS",
    "HEAD_KEYS",
    "IMPLIED",
    "LAYER_NORM_EPS",
    "LAYER_STEMS",
    "LEAF_NAMES",
    "LOGIT_SCALE",
    "MOE_FAMILIES",
    "NOPE_FULL",
    "NOPE_PERIOD",
    "NORM_SHIFT",
    "NO_WINDOW",
    "ONE_BASE",
    "ONE_WIDTH",
    "PARTIAL_ROTARY",
    "PERMUTED",
    "POST_NORM_STEMS",
    "QK_NORM_LAYERS",
    "SANDWICH_STEMS",
    "SCALED",
    "SCALE_KEYS",
    "SCALING_NONE",
    "SHARED_EXPERT",
    "SHARED_MLP",
    "SPLIT_STEMS",
    "SQUARE_ATTENTION",
    "SWA_LAYERS",
    "SWA_PATTERN",
    "SWITCH_FIELDS",
    "TEMPERATURE",
    "TIED",
    "UNBIASED",
    "UNSCALED",
    "UNTIED",
    "WHOLE_HEADS",
    "WINDOWED",
    "WRITTEN_AS",
    "YARN_LOG_MUL",
    "default_layer_types",
    "default_nope_layers",
    "full_layers_nope",
    "gguf_names",
    "layer_stems",
    "split_names",
    "written_name",
]
