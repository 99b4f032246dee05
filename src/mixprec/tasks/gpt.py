"""A small GPT in the style of nanoGPT: pre-norm blocks, fused attention, tied LM head.

The model follows the Hugging Face calling convention so that any training loop written for
``transformers`` models runs it: ``model(input_ids, labels=input_ids)`` shifts the labels inside
(token ``t + 1`` is predicted from tokens ``<= t``), ignores label ``-100`` and returns a
:class:`~mixprec.models.CausalLMOutput`.

Mixed precision: the loss is computed from ``logits.float()``, so it is float32 whether the model
runs in fp32, under bf16/fp16 autocast, or with its parameters cast to bf16 (bf16-true).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.models import CausalLMOutput

__all__ = ["GPTConfig", "GPT"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    Args:
        vocab_size: Number of token ids (256 for byte-level text).
        block_size: Longest sequence the model accepts (the number of learned positions).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        dropout: Dropout probability on attention weights and residual branches.
        bias: Whether linear layers and LayerNorms have a bias (GPT-2 had one; it is not needed).

    Example:
        >>> GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64).n_embd // 2
        32
    """

    vocab_size: int = 256
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0 and h <= 64]
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                             f"choose n_head from {divisors} or change n_embd to a multiple of {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through torch's fused ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        # [batch, time, width] -> [batch, head, time, head_dim], the layout SDPA expects.
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return self.resid_dropout(self.c_proj(y))


class _MLP(nn.Module):
    """The position-wise feed-forward layer: 4x wider, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model with the Hugging Face calling convention.

    Token and learned position embeddings, ``n_layer`` pre-norm blocks, a final LayerNorm and an
    LM head that shares its weight with the token embedding. Initialised as GPT-2: weights
    normal(0, 0.02), residual output projections scaled by ``1 / sqrt(2 * n_layer)``.

    Args:
        config: The model's shape.

    Example:
        >>> model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> out = model(ids, labels=ids)
        >>> out.logits.shape, out["loss"].dtype
        (torch.Size([2, 16, 256]), torch.float32)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}; "
                            "build one with GPTConfig(block_size=..., n_layer=..., n_head=..., n_embd=...)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): one matrix embeds tokens and scores them, which
        # saves vocab_size * n_embd parameters and trains better at this size.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            # GPT-2: each block adds two branches to the residual stream, so their output
            # projections are scaled down to keep the stream's variance independent of depth.
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Count the parameters, the tied embedding / LM head matrix once.

        Args:
            only_trainable: Count only parameters with ``requires_grad``.
            exclude_embeddings: Leave out the token and position embeddings (the usual figure
                quoted for a model's size, as in nanoGPT and Hugging Face).

        Example:
            >>> GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8)).num_parameters()
            2904
        """
        skip = {id(self.wte.weight), id(self.wpe.weight)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if id(p) not in skip and (p.requires_grad or not only_trainable))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """Score every next token, and the loss when ``labels`` are given.

        Args:
            input_ids: Token ids, ``[batch, time]`` with ``time <= block_size``.
            labels: Same shape as ``input_ids``; shifted inside, so pass ``labels=input_ids``.
                Positions labelled ``-100`` are left out of the loss.
            attention_mask: Optional ``[batch, time]``, 1 for real tokens and 0 for padding:
                padded positions are not attended to. Positions are not shifted, so pad on the
                right. Without it the fused causal kernel runs (faster).

        Returns:
            A :class:`CausalLMOutput` with ``logits`` ``[batch, time, vocab]`` in the compute
            dtype and ``loss`` (float32 mean cross-entropy in nats) when ``labels`` are given.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}; "
                             "add a batch dimension with input_ids.unsqueeze(0)")
        time = input_ids.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size {self.config.block_size}; "
                             f"crop the input to its last {self.config.block_size} tokens or build the "
                             "model with a larger GPTConfig.block_size")
        positions = torch.arange(time, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        attn_mask = None if attention_mask is None else _padding_causal_mask(attention_mask, time)
        for block in self.h:
            x = block(x, attn_mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(labels.shape)}; pass labels=input_ids (they are shifted inside)")
            # Cross-entropy in float32: a bf16/fp16 log-softmax over the vocabulary loses the
            # small probabilities that carry most of the gradient.
            shifted = logits[:, :-1, :].float()
            loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``input_ids``, one at a time.

        The context is cropped to the last ``block_size`` tokens. The model's train/eval mode is
        left as it is: call ``model.eval()`` first if it has dropout.

        Args:
            input_ids: The prompt, ``[batch, time]`` (``time >= 1``).
            max_new_tokens: Number of tokens to append.
            temperature: Divides the logits; ``0`` picks the most likely token (greedy).
            top_k: Sample only among the ``top_k`` most likely tokens.
            generator: Random generator for sampling, for reproducible samples.

        Returns:
            ``[batch, time + max_new_tokens]``: the prompt followed by the new tokens.

        Example:
            >>> model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8))
            >>> model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=5).shape
            torch.Size([1, 8])
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {top_k}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, time] prompt, got shape {tuple(input_ids.shape)}")
        ids = input_ids
        for _ in range(max_new_tokens):
            context = ids[:, -self.config.block_size:]
            logits = self(context).logits[:, -1, :].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
        return ids


def _padding_causal_mask(attention_mask: torch.Tensor, time: int) -> torch.Tensor:
    """A boolean ``[batch, 1, time, time]`` mask: causal, padded keys hidden, self always visible."""
    if attention_mask.shape[-1] != time or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, {time}] like input_ids, got shape {tuple(attention_mask.shape)}")
    causal = torch.ones(time, time, dtype=torch.bool, device=attention_mask.device).tril()
    keep = attention_mask.bool()[:, None, None, :]
    # A query whose keys are all padding would get a softmax over nothing (NaN); letting every
    # position see itself keeps padded rows finite, and their outputs are ignored anyway.
    eye = torch.eye(time, dtype=torch.bool, device=attention_mask.device)
    return (causal & keep) | eye
