"""A small GPT-style language model in plain torch, used by the example, the benchmark and the tests.

Decoder-only transformer as in GPT-2: token + learned position embeddings, pre-LayerNorm blocks of
causal self-attention and a 4x GELU MLP, a final LayerNorm, and an LM head tied to the token
embedding. Nothing here knows about Lightning or ZeRO: the strategies shard it as they find it, and
`Block` is the class a stage-3 unit policy targets (one unit per block).

Two ways to draw GPT-2's initial weights (see `GPTConfig.init_per_layer`): by default torch's layers
initialise themselves as they are created and `GPT.__init__` then re-draws every weight, GPT-2's
way, over the whole model; with `init_per_layer=True` each layer draws GPT-2's values in its own
`reset_parameters()`, which is what a model built on the meta device needs (ZeRO-3 materializes
it one layer at a time by calling those).

Shape tags: B batch, T time (sequence length), C channels (n_embd), nh heads, hs head size (C // nh),
V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


INIT_STD = 0.02
"""GPT-2's standard deviation for the weights of every Linear layer and embedding."""


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape, and how its initial weights are drawn."""

    vocab_size: int = 256
    """256: one token per byte, so any text is its own encoding and no tokenizer is needed."""
    block_size: int = 128
    """The longest sequence the position embedding covers."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 128
    """Channels of the residual stream."""
    dropout: float = 0.0
    """Dropout after attention, the MLP and the embeddings; 0.0 because the examples see each byte at
    most a few times, where regularisation only slows learning."""
    bias: bool = True
    """Biases in the Linear layers and LayerNorms, as in GPT-2."""
    init_per_layer: bool = False
    """Each layer draws GPT-2's initial weights in its own `reset_parameters()`, layer by layer as
    they are created, so the model can be built on the meta device and materialized by calling
    those (ZeRO-3's `configure_model`; with a seeded RNG the result equals this model built
    eagerly). False keeps the original order — torch's default init as each layer is created, then
    GPT-2's drawn over the whole model — whose weights the benchmark, the tests and the documentation's
    figures were measured with. Same distributions either way, different random numbers."""

    @property
    def residual_std(self) -> float:
        """GPT-2's scaled init for the projections into the residual stream: each block adds two, so
        its variance grows with depth unless they shrink by 1/sqrt(2 * n_layer)."""
        return INIT_STD / math.sqrt(2 * self.n_layer)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head) < 1:
            raise ValueError(f"vocab_size, block_size, n_layer and n_head must be positive: {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class GPT2Linear(nn.Linear):
    """A Linear layer that initialises as GPT-2's in `reset_parameters()`: weight ~ N(0, std), zero bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = INIT_STD) -> None:
        self.std = std  # set first: nn.Linear.__init__ ends by calling reset_parameters()
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPT2Embedding(nn.Embedding):
    """An embedding that initialises as GPT-2's in `reset_parameters()`: weight ~ N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


def _linear(config: GPTConfig, in_features: int, out_features: int, std: float = INIT_STD, bias: bool = True) -> nn.Linear:
    """A Linear layer for `config`: GPT-2-initialised by itself with `init_per_layer`, else torch's
    own (which `GPT.__init__` re-draws, keeping the original random numbers)."""
    if config.init_per_layer:
        return GPT2Linear(in_features, out_features, bias=bias, std=std)
    return nn.Linear(in_features, out_features, bias=bias)


def _embedding(config: GPTConfig, num_embeddings: int) -> nn.Embedding:
    """An embedding for `config`, as `_linear` chooses a Linear layer."""
    embedding = GPT2Embedding if config.init_per_layer else nn.Embedding
    return embedding(num_embeddings, config.n_embd)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = _linear(config, config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.proj = _linear(config, config.n_embd, config.n_embd, std=config.residual_std, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network; 4x wide as in GPT-2."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = _linear(config, config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = _linear(config, 4 * config.n_embd, config.n_embd, std=config.residual_std, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.gelu(self.fc(x))  # (B, T, 4C)
        return self.dropout(self.proj(x))  # (B, T, C)


class Block(nn.Module):
    """One pre-LayerNorm transformer block; each sublayer adds to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """The language model: `forward(idx, targets)` returns next-token logits and, given targets, the loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = _embedding(config, config.vocab_size)  # token embedding
        self.wpe = _embedding(config, config.block_size)  # learned position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # with init_per_layer its own draw is discarded by the tying below, as a meta build's is
        self.lm_head = _linear(config, config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): reading a token and predicting it share one matrix, which
        # saves V x C parameters and helps small models. One Parameter, two modules: ZeRO stage 3 must
        # keep it in one unit (here the root, outside every Block).
        self.lm_head.weight = self.wte.weight
        if not config.init_per_layer:  # the layers drew GPT-2's values themselves otherwise
            self.apply(self._init_weights)
            for name, param in self.named_parameters():
                if name.endswith("proj.weight"):
                    nn.init.normal_(param, mean=0.0, std=config.residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's; drawn from torch's global RNG, so seeding makes every rank build the same model.
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def num_parameters(self) -> int:
        """Distinct parameters; the tied embedding counts once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """`idx` and `targets` are (B, T) token ids, `targets` being `idx` shifted left by one.

        Returns logits (B, T, V) and the mean cross-entropy over all B x T positions (None without targets).
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None
    ) -> Tensor:
        """Extend `idx` (B, T) by `max_new_tokens` sampled tokens, feeding back the last block_size."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits, _ = self(context)
            logits = logits[:, -1, :] / temperature  # (B, V): only the last position predicts the next
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat([idx, next_token], dim=1)  # (B, T + 1)
        return idx
