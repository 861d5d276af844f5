"""LLaMA through transformers' `LlamaForCausalLM` (no local copy of the model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sdp.models import LlamaConfig, llama_widths
from sdp.models.loss import chunked_cross_entropy

# Causal attention over whole sequences (the data packs them, no padding): transformers' own SDPA
# attention under a name with no mask function, so that no attention mask is built and SDPA runs
# with is_causal. Building one (`sdpa`) reads the position ids back to the host in every forward
# (masking_utils' check for packed sequences): a device synchronisation per step on CUDA.
CAUSAL_SDPA = "sdpa_causal"
AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)


class LlamaLM(transformers.LlamaForCausalLM):
    """transformers' LLaMA, unchanged, whose forward also computes its own loss when given
    next-token `targets`: then it returns (mean cross-entropy, correct predictions or None),
    the LM head run over all tokens at once (`loss_chunk_tokens=None`) or chunk by chunk."""

    def __init__(self, config: transformers.LlamaConfig, *, loss_chunk_tokens: int | None = None):
        super().__init__(config)
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, input_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None, **kwargs):
        if targets is None:
            return super().forward(input_ids=input_ids, **kwargs)
        hidden_ND = self.model(input_ids=input_ids, **kwargs).last_hidden_state.flatten(0, 1)
        targets_N = targets.flatten()
        if self.loss_chunk_tokens is not None:
            return chunked_cross_entropy(self.lm_head, hidden_ND, targets_N, chunk=self.loss_chunk_tokens)
        logits_NV = self.lm_head(hidden_ND)
        loss = F.cross_entropy(logits_NV.float(), targets_N)
        correct = None if torch.is_grad_enabled() else (logits_NV.argmax(-1) == targets_N).sum()
        return loss, correct


def build_llama(cfg: LlamaConfig) -> LlamaLM:
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        **llama_widths(cfg),
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        use_cache=False,
        attn_implementation=CAUSAL_SDPA,
    )
    chunk = cfg.loss_chunk_tokens if cfg.loss == "chunked" else None
    return LlamaLM(hf_cfg, loss_chunk_tokens=chunk)
