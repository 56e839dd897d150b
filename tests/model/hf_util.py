"""Tiny seeded transformers models of every family astrai loads, for the interop tests."""

from __future__ import annotations

import torch

BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
# each family with the features that set it apart, so parity covers them
FAMILY_KWARGS = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "mistral": dict(sliding_window=None, head_dim=16,
                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=16),
    "qwen2_moe": dict(MOE, num_hidden_layers=3, shared_expert_intermediate_size=40, decoder_sparse_step=2),
    "qwen3_moe": dict(MOE, num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, sliding_window=None),
}
MODEL_TYPES = tuple(FAMILY_KWARGS)


def tiny_hf_model(model_type: str, seed: int = 0, **overrides):
    """A random fp32 transformers model; norms and biases are perturbed so they matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**BASE, **FAMILY_KWARGS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:  # routers start at zero in transformers; random ones make routing matter
                p.copy_(0.08 * noise)
    return model


def padded_batch(vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (3, 12): one full row, one right- and one left-padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def max_diff_on_real_tokens(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| over the logits of non-padding positions (padding rows are undefined)."""
    keep = mask.bool()
    return (a[keep] - b[keep]).abs().max().item()
