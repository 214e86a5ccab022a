"""The names of a Hugging Face safetensors export: its index file, the default tensor filter, the dtype choices.

Torch-free, so `shardckpt export --help` can show them without loading torch.
"""

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_INCLUDE = r"^model\."
DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
