"""Train the small GPT-2 that number-words-gpt2-lora.yaml adapts with LoRA.

``number-words-gpt2.safetensors``: `examples/configs/number-words-gpt2.yaml` as
shipped (cardinals in words, from scratch). Its metadata names the tokenizer
(``examples/data/number_words/tokenizer.gguf``, relative to this folder), so
``entrenar generate`` and ``entrenar eval`` find it.
Run: ``python examples/models/make_number_words_gpt2.py`` (a few minutes on a CPU).
"""

from __future__ import annotations

import os
import tempfile

from entrenar import io
from entrenar.runs import train_from_yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "configs", "number-words-gpt2.yaml")
TOKENIZER = os.path.join("..", "data", "number_words", "tokenizer.gguf")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = train_from_yaml(CONFIG, {"training.output_dir": tmp}, progress=False)
        model = io.load_model(run.files["safetensors"])
    meta = model.metadata.with_custom(tokenizer=TOKENIZER)
    target = os.path.join(HERE, "number-words-gpt2.safetensors")
    io.save_model(io.Model(meta, model.params), target)
    print(f"number-words-gpt2.safetensors: {run.metrics}")


if __name__ == "__main__":
    main()
