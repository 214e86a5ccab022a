"""The names of a Hugging Face safetensors export: its index file, the default tensor filter, the dtype choices.

Torch-free, so `shardckpt export --help` can show them without loading torch.
"""

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_INCLUDE = r"^model\."
DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}

# torchtitan's llama layout (llama3 family): its model keys -> Hugging Face LlamaForCausalLM names, as torchtitan's
# own Llama3StateDictAdapter maps them (models/llama3/model/state_dict_adapter.py, torchtitan 0.3.0: from_hf_map
# inverted). "{}" is the layer number. Keys not listed (optimizer state, rotary buffers) are not exported.
TORCHTITAN_LLAMA = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # torchtitan 0.3.0's llama3 names (checked against models/llama3/state_dict_adapter.py of its wheel): the
    # attention projections under qkv_linear, the output projection as lm_head.
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "lm_head.weight": "lm_head.weight",
}
# The rows of wq and wk are permuted per attention head on the way to HF (torchtitan's _permute): Meta's RoPE rotates
# interleaved pairs, HF's rotate_half the two halves of each head.
TORCHTITAN_LLAMA_PERMUTED = {
    "layers.{}.attention.wq.weight": "q",
    "layers.{}.attention.wk.weight": "k",
    "layers.{}.attention.qkv_linear.wq.weight": "q",
    "layers.{}.attention.qkv_linear.wk.weight": "k",
}


def torchtitan_llama_name(name: str) -> tuple[str, str | None] | None:
    """(HF name, "q"/"k" when its rows are permuted per head, else None) of a torchtitan llama key; None if unmapped."""
    parts = name.split(".")
    layer = parts[1] if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() else None
    pattern = ".".join(["layers", "{}", *parts[2:]]) if layer is not None else name
    hf = TORCHTITAN_LLAMA.get(pattern)
    if hf is None:
        return None
    return (hf.format(layer) if layer is not None else hf), TORCHTITAN_LLAMA_PERMUTED.get(pattern)


def is_torchtitan_llama(names: list[str]) -> bool:
    """True for a checkpoint torchtitan saved for a llama model: its embedding and first attention keys at the top."""
    present = set(names)
    return "tok_embeddings.weight" in present and bool(
        {"layers.0.attention.wq.weight", "layers.0.attention.qkv_linear.wq.weight"} & present
    )
