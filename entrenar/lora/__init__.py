"""LoRA and QLoRA as pytree transforms, with adapter files PEFT can read.

Protocol: ``apply(params, LoRAConfig(...), key=...)`` wraps the selected weights in
`LoRAWeight` nodes (``x Wᵀ + s (x Aᵀ) Bᵀ`` through `entrenar.nn.linear`, no model
change; ``quantize="nf4"`` stores the bases 4-bit: QLoRA; ``use_dora=True`` adds
DoRA's magnitude vector, as PEFT's ``use_dora``). ``split`` gives the
``(trainable, frozen)`` halves, gradients are taken w.r.t. the trainable half only,
``combine`` joins them. ``fold`` folds adapters into dense weights (model merging
is `entrenar.merge`), ``unfold``
takes them out; ``save_adapter`` / ``load_adapter`` use Hugging Face PEFT's files.
``fold_retention`` measures how much of the update a file's tensor type keeps, and
``save_folded_gguf`` writes a folded GGUF, warning when the type would erase it.
"""

from entrenar.lora.adapter_io import load_adapter, save_adapter
from entrenar.lora.config import ALL_LINEAR, LoRAConfig
from entrenar.lora.export import Retention, fold_retention, save_folded_gguf
from entrenar.lora.fold import (
    RequantReport,
    delta,
    fold,
    fold_and_requantize,
    unfold,
)
from entrenar.lora.trainable_report import TrainableReport, trainable_report
from entrenar.lora.transform import (
    apply,
    combine,
    split,
    trainable_mask,
    with_dropout_keys,
)
from entrenar.lora.weight import LoRAWeight, with_layer_ranks

__all__ = [
    "ALL_LINEAR",
    "LoRAConfig",
    "LoRAWeight",
    "RequantReport",
    "Retention",
    "TrainableReport",
    "apply",
    "combine",
    "delta",
    "fold",
    "fold_and_requantize",
    "fold_retention",
    "load_adapter",
    "save_adapter",
    "save_folded_gguf",
    "split",
    "trainable_mask",
    "trainable_report",
    "unfold",
    "with_dropout_keys",
    "with_layer_ranks",
]
