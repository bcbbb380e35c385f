"""What the tests ask llama.cpp, and how they get its answers without running it.

llama.cpp is a *recorded oracle*: ``tests/oracles/make_llama_cpp_reference.py`` runs
llama-cpp-python once, where it works, and writes its outputs to ``tests/data/``
(`RECORDED`). The tests compare entrenar against those files, so the suite never loads
llama.cpp into the pytest process (its default build crashes on some CPUs, e.g. in
``decode`` on Intel Xeons with AMX). `live_reference` re-runs the same script in a
subprocess for an extra, live comparison, and turns "llama.cpp is not installed" or
"the subprocess died from a signal" into a skip that names the reason.

This module holds the inputs both sides share: the prompts, the tokenizer corpus, and
the tiny Llama models whose GGUF files entrenar writes for llama.cpp to run.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from entrenar.nn import LlamaConfig, architecture

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "data"
SCRIPT = ROOT / "tests" / "oracles" / "make_llama_cpp_reference.py"
REFERENCE_JSON = "llama_cpp_reference.json"
REFERENCE_NPZ = "llama_cpp_logits.npz"
FAMILIES_JSON = "llama_cpp_families.json"
FAMILIES_NPZ = "llama_cpp_families.npz"
NOT_IMPORTABLE = 77  # the script's exit status when `import llama_cpp` fails

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a"]
GREEDY_STEPS = 6
TINY_KINDS = ("F32", "Q4_0")
TINY_IDS = [504, 3575, 282, 4649, 314, 17, 9]
TINY_SEED = 0
TINY_COLUMN_STEP = 16  # the script keeps every 16th logit column

WORDS = """the of and to in is was for on that with as by at from his an were are which
this be has had it not or have one they first its after new who but two been their
Paris München naïve café résumé façade Straße coöperate jalapeño""".split()
SAMPLES = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "I'm sure you're right; we've seen they'll do it, he'd say. 'S 'LL",
    "   leading spaces",
    "trailing spaces   ",
    "a\n\nb\t\tc\r\nd",
    "x = 12345 + 3.14159 - 0.5e-10",
    "2024-01-15 12:30:45 and 1,000,000 people",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nprint(np.arange(10).reshape(2, 5))",
    '<div class="main">Hello &amp; welcome</div>',
    "Ünïcödé 日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 😀👍🏽 🇪🇸 ok ❤️",
    "١٢٣ ४५६ digits ²³ ½ Ⅻ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "  \n  ",
    "",
    " ",
    "x\u00a0y\u3000z\u2009w",
    "\u0301combining e\u0301",
    "tab\tsep\vvt\fff",
    "$$$ !!! ??? ... --- ___ ***",
    "https://example.com/path?q=1&r=two#frag",
    "CamelCaseWord snake_case_word kebab-case-word",
]
PIECES = [
    *WORDS,
    *[" ", "  ", "\n", "\t", "0", "42", "3.5", ",", ".", "'s", "!?", "é", "日本"],
    *["😀", "<|im_start|>", "()", "{}", "=>", "\u00a0", "'", "''"],
]


def corpus() -> list[str]:
    """`SAMPLES` and 300 strings glued from `PIECES` (326 in all, fixed by seed 0)."""
    rng = random.Random(0)
    out = list(SAMPLES)
    for _ in range(300):
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))))
    return out


def tiny_config() -> LlamaConfig:
    """A 2-layer GQA Llama with SmolLM2's vocabulary (its tokenizer is copied)."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Steele et al.'s SplitMix64 finaliser on uint64 (exact integer arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_weight(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Weights ``k / 32`` with integers ``k`` in [-8, 7], each 32-block holding a -8.

    The values depend only on ``(seed, name, index)`` through integer hashing, so they
    are the same on every machine and numpy version. Every 32-value block along the
    last axis is exactly representable in F16 and Q4_0 (scale 1/32, its largest
    magnitude a -8): the GGUF file entrenar writes from them is the same byte for byte
    wherever it is written, and so is what llama.cpp computes from it.
    """
    assert shape[-1] % 32 == 0, (name, shape)
    base = np.uint64(((seed & 0xFFFF) << 32) | zlib.crc32(name.encode()))
    with np.errstate(over="ignore"):
        idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
        h = _splitmix64(idx + base * np.uint64(1 << 24)).reshape(-1, 32)
    k = (h % np.uint64(15)).astype(np.int64) - 7  # (blocks, 32) in [-7, 7]
    pos = ((h[:, 0] >> np.uint64(40)) % np.uint64(32)).astype(np.int64)  # (blocks,)
    k[np.arange(len(k)), pos] = -8
    return (k.reshape(shape) / 32.0).astype(np.float32)


def tiny_params(config: LlamaConfig, seed: int = TINY_SEED) -> dict:
    """`seeded_weight` for every leaf of ``config.param_shapes()``."""

    def build(tree: dict, prefix: str) -> dict:
        return {
            k: build(v, f"{prefix}{k}.")
            if isinstance(v, dict)
            else seeded_weight(prefix + k, tuple(v), seed)
            for k, v in tree.items()
        }

    return build(config.param_shapes(), "")


ROUTING: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"norm_topk_prob": True},
    "qwen2_moe": {"norm_topk_prob": False},
    # llama.cpp's gpt-oss clamps at 7 (a constant); whole Q8_0 blocks a row
    "gpt_oss": {"swiglu_limit": 7.0, "intermediate_size": 32},
    # llama.cpp's olmoe has no o_proj bias, clips nothing and has no GQA
    "olmoe": {"clip_qkv": None, "attention_out_bias": False, "num_kv_heads": 4},
    # llama.cpp's exaone4 slides only at 64 layers (FAMILY_CASES' exaone4_swa):
    # EXAONE 4.0 1.2B's layout, every layer global and rotating; heads filling
    # the width (its attn_output is {D, D})
    "exaone4": {
        "sliding_window": None,
        "layer_types": None,
        "nope_layers": None,
        "hidden_size": 64,
    },
}
"""The top-k renormalisation llama.cpp's qwen3moe (always) and qwen2moe (never)
compute, where the tiny configs test the other (`gguf_families.EXPERT_NORM`), and
what else a family's tiny has that llama.cpp's graph lacks (GGUF refuses it)."""
FAMILY_LIMITS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},  # llama.cpp's llama has no sliding window
    "mixtral": {"sliding_window": None},
    "qwen3_moe": ROUTING["qwen3_moe"] | {"attention_out_bias": False},
    "qwen2_moe": ROUTING["qwen2_moe"] | {"sliding_window": None, "layer_types": None},
    "qwen2": {"sliding_window": None, "layer_types": None},  # nor its qwen2
    "qwen3": {"sliding_window": None, "layer_types": None, "attention_out_bias": False},
    # llama.cpp's SmolLM3 has no sliding window and no biases
    "smollm3": {
        "sliding_window": None,
        "layer_types": None,
        "attention_bias": False,
        "attention_out_bias": False,
        "mlp_bias": False,
    },
    # llama.cpp's gpt-oss clamps at 7 and rounds YaRN's correction range (ggml's
    # ggml_rope_yarn_corr_dims), where transformers' gpt-oss does not
    "gpt_oss": {"swiglu_limit": 7.0, "rope_truncate": True},
    # llama.cpp's OLMo 2 has no biases and takes d = D / H
    "olmo2": {"attention_bias": False, "attention_out_bias": False},
    # llama.cpp 0.3.36's olmo2 graph rotates sliding layers at the global base
    "olmo3": {
        "attention_bias": False,
        "attention_out_bias": False,
        "rope_local_theta": 500_000.0,
    },
    # llama.cpp's Granite: no q/k/v biases
    "granite": {
        "attention_bias": False,
        "attention_out_bias": False,
        "mlp_bias": False,
    },
    "olmoe": ROUTING["olmoe"],
    "exaone4": ROUTING["exaone4"],
    # llama.cpp's deepseek2 ranks groups by their top-2 sum, V2 by its maximum
    "deepseek_v2": {"topk_method": "greedy"},
    # llama.cpp's Gemma 1 has no biases
    "gemma": {"attention_bias": False, "attention_out_bias": False},
    # llama.cpp's Gemma 2/3 have no o_proj bias and derives the query scale from d
    "gemma2": {"attention_out_bias": False, "query_pre_attn_scalar": None},
    "gemma3": {"attention_out_bias": False, "query_pre_attn_scalar": None},
    # llama.cpp's Cohere graphs have q/k/v biases at most (no o_proj bias), and
    # command-r's per-head q/k norms only with 64 layers (FAMILY_CASES)
    "cohere": {
        "attention_bias": False,
        "attention_out_bias": False,
        "qk_norm": False,
        "qk_norm_heads": False,
    },
    "cohere2": {"attention_bias": False, "attention_out_bias": False},
    # llama.cpp turns Phi-3's sliding window off, and takes the long factors when
    # its context (256 at least) passes the original one
    "phi3": {
        "sliding_window": None,
        "rope_original_max_position_embeddings": 256,
        "max_position_embeddings": 1024,
    },
}
"""What each family's tiny config drops for llama.cpp: features its graph lacks."""


EXAONE4_SWA: dict[str, Any] = dict(
    sliding_window=4,
    layer_types=tuple(
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(64)
    ),
    nope_layers=tuple((i + 1) % 4 == 0 for i in range(64)),
)
"""EXAONE 4.0 32B's 64 layers (window 4 here): llama.cpp's exaone4 default."""


FAMILY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # yarn with config.json's attention_factor: llama.cpp multiplies the file's
    # rope.scaling.attn_factor by its own 0.1 ln(factor) + 1
    "qwen2_yarn": (
        "qwen2",
        dict(rope_type="yarn", rope_factor=4.0,
             rope_original_max_position_embeddings=4, rope_attention_factor=0.8),
    ),
    # Command-R+: llama.cpp's command-r loads per-head q/k norms at 64 layers
    "cohere_qk_norm": (
        "cohere", dict(num_layers=64, qk_norm=True, qk_norm_heads=True),
    ),
    # MXFP4 experts (WRITE_TYPES): gpt-oss as llama.cpp ships it, and the other
    # MoE graphs, whose experts llama.cpp multiplies in any ggml type
    "gpt_oss_mxfp4": ("gpt_oss", {}),
    "mixtral_mxfp4": ("mixtral", {}),
    "qwen3_moe_mxfp4": ("qwen3_moe", dict(moe_intermediate_size=32)),
    # and the routed experts of the families written layer by layer (shared
    # experts, dense layers and attention stay F32)
    "deepseek_v3_mxfp4": ("deepseek_v3", dict(moe_intermediate_size=32)),
    "glm4_moe_mxfp4": ("glm4_moe", dict(moe_intermediate_size=32)),
    # EXAONE 4.0 32B's layout: llama.cpp's exaone4 slides (window 4, every layer
    # but each 4th) and rotates only the sliding layers at 64 layers
    "exaone4_swa": ("exaone4", dict(num_layers=64, **EXAONE4_SWA)),
    # Ministral 3's mscale = mscale_all_dim: the converter's yarn_log_multiplier 1
    "ministral3_mscale": ("ministral3", dict(rope_attention_factor=1.0)),
    # unscaled rotary: the query scale's period in original_context_length
    "ministral3_unscaled": (
        "ministral3", dict(rope_type="default", rope_factor=1.0,
                           rope_original_max_position_embeddings=None),
    ),
}  # fmt: skip
"""Cases beyond each family's own: name -> (family, fields replaced)."""
WRITE_TYPES: dict[str, dict[str, str]] = {
    "gpt_oss_mxfp4": {"expert_type": "MXFP4"},
    "mixtral_mxfp4": {"expert_type": "MXFP4"},
    "qwen3_moe_mxfp4": {"expert_type": "MXFP4"},
    "deepseek_v3_mxfp4": {"expert_type": "MXFP4"},
    "glm4_moe_mxfp4": {"expert_type": "MXFP4"},
}
"""`save_llama_gguf` types of a case other than F32 everywhere."""


def write_types(family: str) -> dict[str, str]:
    """``save_llama_gguf``'s type arguments for ``family`` (a family or a case)."""
    return {"tensor_type": "F32"} | WRITE_TYPES.get(family, {})


def family_config(family: str) -> LlamaConfig:
    """The family's tiny model (``arch.tiny()``) at SmolLM2's vocabulary, for llama.cpp.

    Widths grow to multiples of 32 and the vocabulary is SmolLM2's (the tokenizer the
    file carries); `FAMILY_LIMITS` drops what llama.cpp does not implement.
    ``family`` may also name one of `FAMILY_CASES`.
    """
    family, extra = FAMILY_CASES.get(family, (family, {}))
    tiny = architecture(family).tiny()
    widths = dict(vocab_size=49152, hidden_size=64, intermediate_size=128)
    return dataclasses.replace(tiny, **widths | FAMILY_LIMITS.get(family, {}) | extra)


def family_params(config: LlamaConfig, seed: int = TINY_SEED) -> dict:
    """`seeded_weight` for every leaf (short vectors cut from a longer one)."""

    def weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
        wide = (*shape[:-1], -(-shape[-1] // 32) * 32)
        return seeded_weight(name, wide, seed)[..., : shape[-1]]

    def build(tree: Any, prefix: str) -> Any:
        if isinstance(tree, list):  # DeepSeek's unstacked layers
            return [build(t, f"{prefix}{i}.") for i, t in enumerate(tree)]
        return {
            k: build(v, f"{prefix}{k}.")
            if isinstance(v, (dict, list))
            else weight(prefix + k, tuple(v))
            for k, v in tree.items()
        }

    return build(config.param_shapes(), "")


def gguf_families() -> list[str]:
    """The registered families entrenar writes as llama.cpp GGUF files."""
    from entrenar.io.gguf_families import written_name
    from entrenar.nn import architectures

    return [
        a.name
        for a in architectures()
        if issubclass(a.config_class, LlamaConfig)  # DeepseekConfig too
        and a.tiny is not None
        and written_name(a.name, a.gguf_name)
    ]


def family_cases() -> list[str]:
    """`gguf_families` and `FAMILY_CASES`: the models llama.cpp runs for the tests."""
    return gguf_families() + list(FAMILY_CASES)


def load_families(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The per-family record and arrays the script wrote into ``folder``."""
    with open(folder / FAMILIES_JSON, encoding="utf-8") as f:
        record = json.load(f)
    with np.load(folder / FAMILIES_NPZ, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return record, arrays


def load_reference(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON record and the arrays the script wrote into ``folder``."""
    with open(folder / REFERENCE_JSON, encoding="utf-8") as f:
        record = json.load(f)
    with np.load(folder / REFERENCE_NPZ, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return record, arrays


def _run(out: Path, args: tuple[str, ...], env: dict[str, str]) -> tuple[str, str]:
    """``("ok" | "skip" | "fail", why)`` of the oracle script run into ``out``."""
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    try:
        p = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired as e:
        return "fail", f"{SCRIPT.name} ran past {e.timeout} s"
    tail = p.stderr.strip()[-2000:]
    if p.returncode < 0:
        sig = signal.Signals(-p.returncode).name
        why = f"the llama.cpp subprocess died from {sig} on this machine"
        return "skip", why + (f": {tail[-500:]}" if tail else "")
    if p.returncode == NOT_IMPORTABLE:
        return "skip", f"llama_cpp is not importable in a subprocess: {tail}"
    if p.returncode != 0:
        return "fail", f"{SCRIPT.name} exited with status {p.returncode}:\n{tail}"
    return "ok", ""


def run_script(out: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """Run the oracle script into ``out`` in a subprocess; nothing it does can kill us.

    Skips (with the reason) when llama_cpp is not importable there or the subprocess
    dies from a signal (llama.cpp crashing on this CPU); fails on any other error.
    """
    status, why = _run(out, args, env or {})
    if status == "skip":
        pytest.skip(why)
    if status == "fail":
        pytest.fail(why)


@functools.cache
def _live() -> tuple[str, str, Path]:
    """Run the script once per pytest process into a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="llama_cpp_live_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return (*_run(out, (), {}), out)


def reference(source: str) -> tuple[dict, dict[str, np.ndarray]]:
    """llama.cpp's answers: ``"recorded"`` in tests/data, or ``"live"`` ones.

    Live answers come from the script run now in a subprocess (once per pytest run);
    they skip or fail as `run_script` does.
    """
    if source == "recorded":
        return load_reference(RECORDED)
    status, why, out = _live()
    if status == "skip":
        pytest.skip(why)
    if status == "fail":
        pytest.fail(why)
    return load_reference(out)
