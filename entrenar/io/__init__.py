"""Model I/O: JSON, YAML, safetensors and GGUF files, Hugging Face folders, llama.cpp.

Protocol: ``save_model(Model(metadata, params), path, SaveConfig(format))`` writes
atomically; ``load_model(path)`` detects the format from magic bytes and extension and
validates every size before allocating, raising `entrenar.errors.FormatError` naming
the file and field. Params are nested dicts of arrays stored by dotted name.
``load_hf_folder(folder)`` reads a Hugging Face folder of any registered family
(`HFTokenizer` its tokenizer files) and ``save_hf_folder`` writes one;
``load_llama_gguf(path)`` maps a llama.cpp GGUF to ``(LlamaConfig, params,
tokenizer_info)``; ``save_llama_gguf`` writes one back; `BPETokenizer` tokenizes as
llama.cpp does. specs/io.md documents each format.
"""

from entrenar.io.atomic import atomic_write
from entrenar.io.formats import detect_format, file_architecture, load_model, save_model
from entrenar.io.ggml_dequant import (
    DEQUANTIZABLE,
    GGML_TYPE_IDS,
    GGML_TYPES,
    GGMLType,
    dequantize_ggml,
)
from entrenar.io.gguf_reader import (
    GGUFField,
    GGUFFile,
    GGUFMetadata,
    GGUFTensorInfo,
    GGUFValueType,
    read_gguf,
)
from entrenar.io.gguf_writer import GGUFTensor, tensor_from_array, write_gguf
from entrenar.io.hf_folder import (
    HFFolder,
    folder_dtype,
    load_hf_folder,
    load_hf_llama,
    read_hf_folder,
    read_hf_llama_header,
    save_hf_folder,
)
from entrenar.io.hf_tokenizer import HFTokenizer, tokenizer_files
from entrenar.io.json_yaml import load_json, load_yaml, save_json, save_yaml
from entrenar.io.llama_gguf import (
    llama_config_from_gguf,
    load_llama_gguf,
    load_tokenizer,
    permute_qk,
    read_llama_header,
    unpermute_qk,
    unpermuted_rows,
)
from entrenar.io.llama_gguf_write import check_llama_gguf, save_llama_gguf
from entrenar.io.model import (
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    flatten_params,
    restore_quantized,
    split_quantized,
    unflatten_params,
)
from entrenar.io.models_pkg import smollm2_path
from entrenar.io.safetensors_io import read_safetensors, save_safetensors
from entrenar.io.tokenizer import BPETokenizer

__all__ = [
    "DEQUANTIZABLE",
    "GGML_TYPES",
    "GGML_TYPE_IDS",
    "BPETokenizer",
    "GGMLType",
    "GGUFField",
    "GGUFFile",
    "GGUFMetadata",
    "GGUFTensor",
    "GGUFTensorInfo",
    "GGUFValueType",
    "HFFolder",
    "HFTokenizer",
    "Model",
    "ModelFormat",
    "ModelMetadata",
    "SaveConfig",
    "atomic_write",
    "check_llama_gguf",
    "dequantize_ggml",
    "detect_format",
    "file_architecture",
    "flatten_params",
    "folder_dtype",
    "llama_config_from_gguf",
    "load_hf_folder",
    "load_hf_llama",
    "load_json",
    "load_llama_gguf",
    "load_model",
    "load_tokenizer",
    "load_yaml",
    "permute_qk",
    "read_gguf",
    "read_hf_folder",
    "read_hf_llama_header",
    "read_llama_header",
    "read_safetensors",
    "restore_quantized",
    "save_hf_folder",
    "save_json",
    "save_llama_gguf",
    "save_model",
    "save_safetensors",
    "save_yaml",
    "smollm2_path",
    "split_quantized",
    "tensor_from_array",
    "tokenizer_files",
    "unflatten_params",
    "unpermute_qk",
    "unpermuted_rows",
    "write_gguf",
]
