"""LLaMA through transformers' `LlamaForCausalLM` (no local copy of the model)."""

from __future__ import annotations

import transformers

from sdp.models import LlamaConfig


def build_llama(cfg: LlamaConfig) -> transformers.LlamaForCausalLM:
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(hf_cfg)
