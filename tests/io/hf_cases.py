"""Tiny Hugging Face tokenizers and chat templates of each family, built in the test.

`write_tokenizer(folder, family)` writes a ``tokenizer.json`` trained with
``tokenizers`` on a few sentences (vocabulary of about 300), in the family's style,
with its special tokens, ``tokenizer_config.json`` and chat template:

- byte-level BPE (GPT-2 bytes, no normalizer) for Llama 3 and Qwen2/3, split by the
  GPT-2 regex; the ``llama3_split`` and ``qwen2_split`` styles split by those
  families' own regexes (with Llama 3's ``ignore_merges``, Qwen2's NFC normalizer),
  as their files do; Cohere's (Command-R, Aya, Command-R7B): NFC, each digit its own
  piece, then GPT-2 bytes (transformers' ``CohereTokenizer``);
- SentencePiece-style BPE (``▁`` for spaces, ``<0xNN>`` byte fallback) for Mistral,
  Phi-3 (a ``▁`` prepended, as Llama 2's tokenizer does; its chat tokens ``rstrip``
  as in Phi-3's file) and Gemma (none prepended).

The templates are shortened copies of the families' own (same tokens and layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text: café, naïve, 日本語, emoji 😀.",
    "Numbers 12345 and 3.14159 in a sentence.",
] * 8
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "café 😀 日本語 unseen words zqxj",
    "line one\nline two\ttab",
    "",
]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
    "{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == "
    "'assistant' else m['role'] %}{{ '<start_of_turn>' + role + '\n' + "
    "m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
COHERE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set role = 'CHATBOT' %}{% else %}{% set role = m['role'] | upper %}{% endif %}"
    "{{ '<|START_OF_TURN_TOKEN|><|' + role + '_TOKEN|>' + m['content'] | trim + "
    "'<|END_OF_TURN_TOKEN|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\n' + m['content'] + "
    "'<|end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLIT_REGEX = {
    "llama3": _WORDS + r"\p{N}{1,3}" + _REST,
    "qwen2": _WORDS + r"\p{N}" + _REST,
}
"""The split regexes of Llama 3's and Qwen2's ``tokenizer.json``, as they spell them."""

STYLES: dict[str, dict[str, Any]] = {
    "llama": dict(
        kind="byte",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
        template=LLAMA3_TEMPLATE, cls="PreTrainedTokenizerFast",
        generation_eos=["<|end_of_text|>", "<|eot_id|>"],
    ),
    "qwen": dict(
        kind="byte", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=CHATML_TEMPLATE,
        cls="Qwen2Tokenizer", generation_eos=["<|im_end|>", "<|endoftext|>"],
    ),
    "llama3_split": dict(
        kind="byte", pre="llama3", ignore_merges=True,
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
        template=LLAMA3_TEMPLATE, cls="PreTrainedTokenizerFast",
        generation_eos=["<|end_of_text|>", "<|eot_id|>"],
    ),
    "qwen2_split": dict(
        kind="byte", pre="qwen2", nfc=True,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=CHATML_TEMPLATE,
        cls="Qwen2Tokenizer", generation_eos=["<|im_end|>", "<|endoftext|>"],
    ),
    "mistral": dict(
        kind="sp", prepend=True, specials=["<unk>", "<s>", "</s>"], bos="<s>",
        eos="</s>", pad=None, unk="<unk>", template=MISTRAL_TEMPLATE,
        cls="LlamaTokenizer", generation_eos=["</s>"],
    ),
    "phi3": dict(
        kind="sp", prepend=True,
        specials=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>",
                  "<|user|>", "<|system|>", "<|end|>"],
        bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>",
        rstrip=["</s>", "<|assistant|>", "<|user|>", "<|system|>", "<|end|>"],
        template=PHI3_TEMPLATE, cls="LlamaTokenizer",
        generation_eos=["<|endoftext|>", "<|end|>"],
    ),
    "cohere": dict(
        kind="byte", digits=True, nfc=True,
        specials=["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>",
                  "<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                  "<|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"],
        bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", unk="<UNK>",
        template=COHERE_TEMPLATE, cls="CohereTokenizer",
        generation_eos=["<|END_OF_TURN_TOKEN|>", "<EOS_TOKEN>"],
    ),
    "gemma": dict(
        kind="sp", prepend=False,
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                  "<end_of_turn>"],
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", template=GEMMA_TEMPLATE,
        cls="GemmaTokenizer", generation_eos=["<eos>", "<end_of_turn>"],
    ),
}  # fmt: skip
FAMILY_STYLE = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "mixtral": "mistral",
    "qwen2_moe": "qwen",
    "qwen3_moe": "qwen",
    "cohere": "cohere",
    "cohere2": "cohere",
}


def tokenizer_json(style: dict[str, Any]) -> str:
    """A trained ``tokenizer.json`` text in ``style``."""
    import tokenizers as hf
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    specials = list(style["specials"])
    if style["kind"] == "byte":
        regex = SPLIT_REGEX.get(style.get("pre", "gpt2"))
        t = hf.Tokenizer(models.BPE(ignore_merges=style.get("ignore_merges", False)))
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if style.get("digits"):  # Cohere's: each digit alone, then bytes
            t.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=False)]
            )  # fmt: skip
        elif regex is not None:  # Llama 3's and Qwen2's: a Split, then bytes
            split = pre_tokenizers.Split(hf.Regex(regex), behavior="isolated")
            t.pre_tokenizer = pre_tokenizers.Sequence(
                [split, pre_tokenizers.ByteLevel(False, use_regex=False)]
            )
        if style.get("nfc"):
            t.normalizer = normalizers.NFC()
        t.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        extra: list[str] = []
    else:
        t = hf.Tokenizer(models.BPE(byte_fallback=True, unk_token=style["unk"]))
        steps = [normalizers.Replace(" ", "\u2581")]
        if style["prepend"]:
            steps.insert(0, normalizers.Prepend("\u2581"))
        t.normalizer = normalizers.Sequence(steps)
        dec = [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
        if style["prepend"]:
            dec.append(decoders.Strip(" ", 1, 0))
        t.decoder = decoders.Sequence(dec)
        alphabet = ["\u2581"]
        extra = [f"<0x{b:02X}>" for b in range(256)]
    trainer = hf.trainers.BpeTrainer(
        vocab_size=300 + len(extra),
        special_tokens=specials + extra,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    t.train_from_iterator(CORPUS, trainer)
    if style["bos"] is not None:
        bos = style["bos"]
        t.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, t.token_to_id(bos))]
        )
    doc = json.loads(t.to_str())
    # Byte tokens belong to the vocabulary, not to the added (special) tokens.
    doc["added_tokens"] = [
        a for a in doc["added_tokens"] if not a["content"].startswith("<0x")
    ]
    for a in doc["added_tokens"]:  # Phi-3's file: whitespace after these is eaten
        a["rstrip"] = a["content"] in style.get("rstrip", ())
    return json.dumps(doc, ensure_ascii=False)


def write_tokenizer(folder: Path, family: str) -> dict[str, Any]:
    """Write the family's tiny tokenizer files into ``folder``; returns its style.

    ``family`` is a model family (`FAMILY_STYLE`) or a style name (`STYLES`).
    """
    style = STYLES[FAMILY_STYLE.get(family, family if family in STYLES else "qwen")]
    folder.mkdir(parents=True, exist_ok=True)
    text = tokenizer_json(style)
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    vocab = json.loads(text)["model"]["vocab"]
    config: dict[str, Any] = {
        "tokenizer_class": style["cls"],
        "bos_token": style["bos"],
        "eos_token": style["eos"],
        "pad_token": style["pad"],
        "chat_template": style["template"],
        "add_bos_token": style["bos"] is not None,
        "add_eos_token": False,
    }
    if "unk" in style:
        config["unk_token"] = style["unk"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    eos = [vocab[t] for t in style["generation_eos"]]
    gen = {"eos_token_id": eos if len(eos) > 1 else eos[0]}
    (folder / "generation_config.json").write_text(json.dumps(gen), "utf-8")
    return style


MESSAGES = [
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hi, how are you?"},
    {"role": "user", "content": "The quick brown fox."},
]

GGUF_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "café naïve Ünïcödé résumé",
    "cafe\u0301 (decomposed accent)",
    "日本語のテキスト 中文",
    "emoji 😀🎉 and 👍🏽 ok",
    "12345 3.14159 in 2024, 1000000",
    "a\n\nb\n \n  c\t\td\r\ne",
    "   ",
    "\n",
    "",
    "don't you'll I'M we've",
    "def add(a, b):\n    return a + b\n",
    "zqxj unseen wörds",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<s>[INST] hi [/INST] yo</s>",
    "<start_of_turn>model\nhey<end_of_turn>",
    "<|user|>\nquestion<|end|>\n<|assistant|>",
]
"""Test strings for a tokenizer written to GGUF: ASCII, accents (one decomposed), CJK,
emoji, digits, runs of spaces and newlines, every style's special tokens."""
