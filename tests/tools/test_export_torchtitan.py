"""`shardckpt export` of a checkpoint torchtitan saved for a llama model: one command gives Hugging Face's
LlamaForCausalLM names, wq and wk permuted per head so that HF's rotate_half RoPE computes the attention scores
torchtitan's interleaved RoPE computed (checked here with both RoPE formulas, not against torchtitan's own code)."""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.errors import ShardckptUsageError
from shardckpt.tools.export import export_hf_safetensors
from tests.tools.test_export import exported

DIM, HEADS, KV_HEADS, LAYERS = 16, 4, 2, 2
HEAD_DIM = DIM // HEADS


def titan_state() -> dict:
    generator = torch.Generator().manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    state: dict = {"tok_embeddings.weight": rand(11, DIM), "norm.weight": rand(DIM), "output.weight": rand(11, DIM)}
    for layer in range(LAYERS):
        state[f"layers.{layer}.attention.wq.weight"] = rand(HEADS * HEAD_DIM, DIM)
        state[f"layers.{layer}.attention.wk.weight"] = rand(KV_HEADS * HEAD_DIM, DIM)
        state[f"layers.{layer}.attention.wv.weight"] = rand(KV_HEADS * HEAD_DIM, DIM)
        state[f"layers.{layer}.attention.wo.weight"] = rand(DIM, HEADS * HEAD_DIM)
        state[f"layers.{layer}.feed_forward.w1.weight"] = rand(24, DIM)
        state[f"layers.{layer}.feed_forward.w2.weight"] = rand(DIM, 24)
        state[f"layers.{layer}.feed_forward.w3.weight"] = rand(24, DIM)
        state[f"layers.{layer}.attention_norm.weight"] = rand(DIM)
        state[f"layers.{layer}.ffn_norm.weight"] = rand(DIM)
    # What else torchtitan's flattened state holds beside the model: never exported.
    state["optimizer.state.tok_embeddings.weight.exp_avg"] = rand(11, DIM)
    state["optimizer.param_groups.tok_embeddings.weight.lr"] = 3e-4
    state["train_state"] = {"step": 10}
    return state


def rope_meta(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """torchtitan's apply_rotary_emb: interleaved pairs (2a, 2a+1) as complex numbers times e^(i angle_a)."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def rope_hf(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, the halves (a, a + d/2) paired."""
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x.double() * cos + rotated.double() * sin


def scores(wq: torch.Tensor, wk: torch.Tensor, rope, x: torch.Tensor) -> torch.Tensor:
    """Attention logits per head for tokens x (grouped-query: query head h reads key head h // (HEADS/KV_HEADS))."""
    positions = torch.arange(x.shape[0], dtype=torch.float64)
    angles = positions[:, None] * (10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    q = rope((x @ wq.T).view(-1, HEADS, HEAD_DIM).transpose(0, 1), angles)
    k = rope((x @ wk.T).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1), angles)
    return q @ k.repeat_interleave(HEADS // KV_HEADS, 0).transpose(1, 2)


def test_a_torchtitan_llama_checkpoint_exports_to_hf_names_with_one_command(tmp_path) -> None:
    state = titan_state()
    url = str(tmp_path / "step-10")
    shardckpt.save(state, url, step=10)
    assert cli_main(["export", url, str(tmp_path / "hf"), "--heads", str(HEADS)]) == 0
    hf = exported(tmp_path / "hf")
    assert set(hf) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        *(
            f"model.layers.{layer}.{name}.weight"
            for layer in range(LAYERS)
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.down_proj",
                "mlp.up_proj",
                "input_layernorm",
                "post_attention_layernorm",
            )
        ),
    }
    assert torch.equal(hf["model.layers.1.mlp.gate_proj.weight"], state["layers.1.feed_forward.w1.weight"])
    assert torch.equal(hf["model.layers.1.self_attn.v_proj.weight"], state["layers.1.attention.wv.weight"])
    assert torch.equal(hf["lm_head.weight"], state["output.weight"])
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for layer in range(LAYERS):
        wq, wk = state[f"layers.{layer}.attention.wq.weight"], state[f"layers.{layer}.attention.wk.weight"]
        hq, hk = (
            hf[f"model.layers.{layer}.self_attn.q_proj.weight"],
            hf[f"model.layers.{layer}.self_attn.k_proj.weight"],
        )
        assert not torch.equal(hq, wq)  # permuted ...
        expected = scores(wq.double(), wk.double(), rope_meta, x)
        torch.testing.assert_close(scores(hq.double(), hk.double(), rope_hf, x), expected)  # ... to the same logits
    # bf16 output, and the same under a memory bound of a few heads.
    report = export_hf_safetensors(url, str(tmp_path / "bf16"), heads=HEADS, dtype="bf16", memory_limit=1 << 20)
    assert report.tensors == len(hf)
    assert exported(tmp_path / "bf16")["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_without_heads_or_with_wrong_heads_the_export_says_what_it_needs(tmp_path) -> None:
    url = str(tmp_path / "step-10")
    shardckpt.save(titan_state(), url, step=10)
    with pytest.raises(ShardckptUsageError, match="needs the model's number of heads.*--heads N"):
        export_hf_safetensors(url, str(tmp_path / "hf"))
    with pytest.raises(ShardckptUsageError, match="does not split into 3 heads"):
        export_hf_safetensors(url, str(tmp_path / "hf"), heads=3)
    with pytest.raises(ShardckptUsageError, match="does not hold 4 heads"):
        export_hf_safetensors(url, str(tmp_path / "hf"), heads=HEADS, kv_heads=4)
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    # --include keeps the plain export (names as stored): the user chose.
    export_hf_safetensors(url, str(tmp_path / "raw"), include=r"^layers\.0\.attention\.wq")
    assert list(exported(tmp_path / "raw")) == ["layers.0.attention.wq.weight"]


def test_torchtitan_0_3_names_export_the_same(tmp_path) -> None:
    """torchtitan 0.3.0's llama3 keeps wq/wk/wv under attention.qkv_linear and the output as lm_head (its
    state_dict_adapter.py): the same one-command export, the same permuted logits."""
    old = titan_state()
    renamed = {
        name.replace(".attention.w", ".attention.qkv_linear.w") if ".attention.w" in name and ".wo." not in name
        else ("lm_head.weight" if name == "output.weight" else name): value
        for name, value in old.items()
    }  # fmt: skip
    url = str(tmp_path / "step-10")
    shardckpt.save(renamed, url, step=10)
    assert cli_main(["export", url, str(tmp_path / "hf"), "--heads", str(HEADS)]) == 0
    hf = exported(tmp_path / "hf")
    reference_url = str(tmp_path / "old")
    shardckpt.save(old, reference_url, step=10)
    assert cli_main(["export", reference_url, str(tmp_path / "hf-old"), "--heads", str(HEADS)]) == 0
    expected = exported(tmp_path / "hf-old")
    assert set(hf) == set(expected)
    assert all(torch.equal(hf[name], expected[name]) for name in hf)
