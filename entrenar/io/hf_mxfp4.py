"""gpt-oss's routed experts written as the Hub's MXFP4 tensors (`save_hf_folder`).

openai/gpt-oss-20b and -120b ship their experts as MXFP4 (OCP MX v1.0: a shared
E8M0 scale per 32 values, FP4 E2M1 codes; `entrenar.nn.mxfp4`), 4.25 bits a value:
gpt-oss-20b is 13 GB so, 42 GB in bfloat16. ``save_hf_folder(...,
expert_type="MXFP4")`` writes a gpt-oss folder the same way, so a fine-tune (the
LoRA adapters folded into the experts) keeps the size and layout vLLM and
transformers load:

- each layer's ``mlp.experts.gate_up_proj (E, D, 2I)`` and ``down_proj (E, I, D)``
  (transformers' ``x @ W`` layout) are stored transposed to ``(E, out, in)`` and
  quantized along ``in``: ``{name}_blocks (E, out, in / 32, 16)`` and
  ``{name}_scales (E, out, in / 32)``, both uint8 (`nn.mxfp4.quantize_hf`: the
  smallest power-of-two scale with ``max |w| / scale <= 6``, the rounding-up rule
  of transformers' own quantizer, and the nearest code);
- ``config.json`` gets the Hub's ``quantization_config`` (`QUANTIZATION_CONFIG`);
- every other tensor (attention, router, biases, embeddings, head) is written as
  without it (``dtype``).

Each stack is quantized when its shard is written (one layer's experts in float32
at a time, then its blocks and scales). Only gpt-oss has this form: transformers'
MXFP4 integration reads gpt-oss's experts and nothing else.

`entrenar.merge`, which merges a folder's stored tensors one by one, reads each
pair as one float stack (`read_mxfp4_stacks`: an `MXFP4Stack`, dequantized when
its turn comes), so MXFP4 and float folders of one model merge together, and
writes the merged stacks as MXFP4 again when the base folder held them so
(`write_mxfp4_stacks`, `mxfp4_stacks`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from entrenar import nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.nn.mxfp4 import BLOCK, dequantize_hf, quantize_hf
from entrenar.nn.weight_node import is_weight_node

QUANTIZATION_CONFIG: dict[str, Any] = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
"""openai/gpt-oss-20b's ``config.json`` ``quantization_config``."""

STACK = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
"""The expert stacks stored as MXFP4 (transformers' names, before the suffixes)."""

Spec = tuple[np.dtype, tuple[int, ...]]
_BYTES = (np.dtype(np.uint8), np.dtype(np.uint8))


def check_hf_expert_type(config: Any, expert_type: str | None) -> str | None:
    """``expert_type`` upper-cased, checked for ``config``; None stays None.

    Raises:
        ConfigError: a type other than MXFP4, or experts whose rows
            (``hidden_size``, ``expert_size``) are not whole 32-value blocks.
        UnsupportedError: a family other than gpt-oss.

    >>> import dataclasses
    >>> tiny = nn.architecture("gpt_oss").tiny()  # experts 24 wide: not whole blocks
    >>> check_hf_expert_type(dataclasses.replace(tiny, intermediate_size=64), "mxfp4")
    'MXFP4'
    """
    if expert_type is None:
        return None
    kind = expert_type.upper()
    if kind != "MXFP4":
        raise ConfigError(
            f"Hugging Face expert type {expert_type!r}: expected 'MXFP4' (or none: "
            "the experts in the folder's float dtype)"
        )
    family = nn.architecture_of(config).name
    if family != "gpt_oss":
        raise UnsupportedError(
            f"MXFP4 experts in a Hugging Face folder are gpt-oss's form (the only "
            f"one transformers reads); a {family} folder holds its experts as "
            "floats: leave the expert type unset"
        )
    widths = (config.hidden_size, config.expert_size)
    if any(w % BLOCK for w in widths):
        raise ConfigError(
            f"MXFP4 experts need rows of whole {BLOCK}-value blocks; this gpt_oss "
            f"config has hidden_size {config.hidden_size} and expert_size "
            f"{config.expert_size}: leave the expert type unset"
        )
    return kind


def mxfp4_stacks(
    made: Mapping[str, Callable[[], Any]], specs: Mapping[str, Spec]
) -> tuple[dict[str, Callable[[], Any]], dict[str, Spec]]:
    """``made`` and ``specs`` with each `STACK` as its ``_blocks`` and ``_scales``.

    ``specs[name]`` is the float stack's ``(dtype, (E, in, out))``; the pair's
    makers share one quantization (the blocks' maker keeps the scales for the
    scales' maker, written next).
    """
    made, specs = dict(made), dict(specs)
    for name in [n for n in made if STACK.match(n)]:
        make = made.pop(name)
        _, (e, fan_in, out) = specs.pop(name)
        pair = _Pair(make, name)
        made[f"{name}_blocks"], made[f"{name}_scales"] = pair.blocks, pair.scales
        g = fan_in // BLOCK
        specs[f"{name}_blocks"] = (np.dtype(np.uint8), (e, out, g, BLOCK // 2))
        specs[f"{name}_scales"] = (np.dtype(np.uint8), (e, out, g))
    return made, specs


def _quantize_stack(w: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A float stack ``(E, in, out)`` (or its weight node) as its stored pair."""
    w = nn.to_dense(w) if is_weight_node(w) else w
    stack = np.swapaxes(np.asarray(w, np.float32), 1, 2)  # (E, out, in)
    return quantize_hf(stack, name)


class _Pair:
    """One stack's blocks and scales, quantized once when the first is made."""

    def __init__(self, make: Callable[[], Any], name: str) -> None:
        self.make, self.name = make, name
        self.kept: tuple[np.ndarray, np.ndarray] | None = None

    def _quantized(self) -> tuple[np.ndarray, np.ndarray]:
        if self.kept is None:
            self.kept = _quantize_stack(self.make(), self.name)
        return self.kept

    def blocks(self) -> np.ndarray:
        return self._quantized()[0]

    def scales(self) -> np.ndarray:
        out = self._quantized()[1]
        self.kept = None  # (written after the blocks: nothing held afterwards)
        return out


class MXFP4Stack:
    """A stored ``{name}_blocks`` / ``{name}_scales`` pair read as its float stack.

    ``shape`` and ``dtype`` are the float stack's (transformers' ``(E, in, out)``,
    bfloat16, which holds every MXFP4 value exactly); ``np.asarray`` dequantizes
    it then (`nn.mxfp4.dequantize_hf`), so a reader that takes a model tensor by
    tensor (`entrenar.merge`) holds one stack's values at a time.
    """

    def __init__(self, name: str, blocks: Any, scales: Any, where: str = "") -> None:
        b, s = np.shape(blocks), np.shape(scales)
        dtypes = (
            np.dtype(getattr(blocks, "dtype", None)),
            np.dtype(getattr(scales, "dtype", None)),
        )
        if len(b) != 4 or b[-1] != BLOCK // 2 or b[:-1] != s or dtypes != _BYTES:
            raise FormatError(
                f"{where}: {name}_blocks {b} {dtypes[0]} / {name}_scales {s} "
                f"{dtypes[1]}: MXFP4 expert stacks are (E, out, in / {BLOCK}, "
                f"{BLOCK // 2}) and (E, out, in / {BLOCK}) uint8"
            )
        self.name, self.blocks, self.scales, self.where = name, blocks, scales, where
        self.shape = (b[0], b[2] * BLOCK, b[1])  # (E, in, out)
        self.dtype = np.dtype(ml_dtypes.bfloat16)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        try:  # (E, out, in)
            w = dequantize_hf(self.blocks, self.scales, ml_dtypes.bfloat16)
        except FormatError as e:  # scales out of range
            raise FormatError(f"{self.where}: {self.name}: {e}") from None
        w = np.ascontiguousarray(np.swapaxes(w, 1, 2))  # (E, in, out)
        return w if dtype is None else w.astype(dtype)

    def __repr__(self) -> str:
        return f"MXFP4Stack({self.name!r}, shape={self.shape})"


def read_mxfp4_stacks(leaves: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``leaves`` (stored names) with each `STACK` pair as one `MXFP4Stack`.

    Raises:
        FormatError: a stack's blocks without its scales or the reverse, or a
            pair not of uint8 ``(E, out, G, 16)`` / ``(E, out, G)``, naming
            ``where`` (the file) and the tensor.
    """
    out = dict(leaves)
    for name in list(out):
        stem, _, part = name.rpartition("_")
        if part not in ("blocks", "scales") or not STACK.match(stem):
            continue
        if stem in out:  # (its pair, read already)
            continue
        blocks = out.pop(f"{stem}_blocks", None)
        scales = out.pop(f"{stem}_scales", None)
        if blocks is None or scales is None:
            raise FormatError(
                f"{where}: {stem} has MXFP4 {part} without its "
                f"{'scales' if part == 'blocks' else 'blocks'}"
            )
        out[stem] = MXFP4Stack(stem, blocks, scales, where)
    return out


def write_mxfp4_stacks(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` (transformers' names) with each float `STACK` as its MXFP4 pair."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if STACK.match(name):
            out[f"{name}_blocks"], out[f"{name}_scales"] = _quantize_stack(value, name)
        else:
            out[name] = value
    return out


__all__ = [
    "QUANTIZATION_CONFIG",
    "MXFP4Stack",
    "check_hf_expert_type",
    "mxfp4_stacks",
    "read_mxfp4_stacks",
    "write_mxfp4_stacks",
]
