"""The GPT-style decoder: token embedding, blocks of (RMSNorm, RoPE attention, SwiGLU MLP), head.

Layers live in a `ModuleDict` keyed by their index in the full model, so a pipeline stage that
keeps only some of them (and drops the embedding or the head) still has the same parameter names
as the whole model: checkpoints load across layouts. Attention reshapes with `-1` heads so tensor
parallelism can shard heads without this module knowing.

Models are built on the meta device (`skeleton`: shapes, no memory), parallelised there, and only
then materialised (`materialize`): a rank allocates its shard of an 8B or 70B model, never the
whole. Each parameter is drawn from its own generator, seeded by the recipe's seed and the
parameter's name, and each rank keeps its shard of that draw: every layout starts from the same
weights as a single-process run. This module builds and runs modules only: no process groups, no
devices beyond the one it is given.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from vigil.trainer import recipes


def rope_tables(cfg: recipes.ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2) for rotary position embedding."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x: (batch, seq, heads, head_dim)."""
    seq = x.shape[1]
    cos = cos[:seq].view(1, seq, 1, -1)
    sin = sin[:seq].view(1, seq, 1, -1)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out


class Attention(nn.Module):
    def __init__(self, cfg: recipes.ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        return projected


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: recipes.ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self, cfg: recipes.ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = x + self.attention(self.attention_norm(x), cos, sin)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    """The whole decoder, or one pipeline stage of it (missing parts are None)."""

    tok_embeddings: nn.Embedding | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    norm: RMSNorm | None
    output: nn.Linear | None

    def __init__(self, cfg: recipes.ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        # Not persistent: derived from the config, so checkpoints do not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_rope(self, device: torch.device) -> None:
        """Recompute the rope tables on `device` (after materialising from meta)."""
        cos, sin = rope_tables(self.cfg)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def init_weights(self, seed: int) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), norms 1.
        Each parameter is drawn whole from a generator seeded by `seed` and its name (wrappers
        left out), and a sharded parameter (DTensor) keeps its shard: the weights do not depend
        on the layout."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                name = canonical_name(name)
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.device.type == "meta":
                    continue
                if param.dim() < 2:
                    local.fill_(1.0)
                    continue
                std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                full = _draw(param.shape, std, _param_seed(seed, name), local)
                if isinstance(param, DTensor):
                    full = distribute_tensor(
                        full, param.device_mesh, param.placements, src_data_rank=None
                    ).to_local()
                local.copy_(full)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h).float() if self.output is not None else h

    def keep_only(self, layer_ids: list[int], *, first: bool, last: bool) -> Transformer:
        """Drop every part this pipeline stage does not own; returns self."""
        keep = {str(i) for i in layer_ids}
        for key in [k for k in self.layers if k not in keep]:
            del self.layers[key]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = None
            self.output = None
        return self


class StageView(Transformer):
    """A pipeline stage sharing modules with its rank's model (interleaved schedules).

    Parameter names match the full model, so one optimizer and one checkpoint state dict over the
    rank's model cover every virtual stage it runs.
    """

    def __init__(self, owner: Transformer, layer_ids: list[int], *, first: bool, last: bool):
        nn.Module.__init__(self)
        self.cfg = owner.cfg
        self.tok_embeddings = owner.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): owner.layers[str(i)] for i in layer_ids})
        self.norm = owner.norm if last else None
        self.output = owner.output if last else None
        self.register_buffer("rope_cos", owner.rope_cos, persistent=False)
        self.register_buffer("rope_sin", owner.rope_sin, persistent=False)


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model (activation-checkpoint and compile wrappers out)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _draw(shape: torch.Size, std: float, seed: int, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator(device=like.device)
    generator.manual_seed(seed)
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    return out.normal_(0.0, std, generator=generator)


def skeleton(cfg: recipes.ModelConfig) -> Transformer:
    """The full model on the meta device: every shape, no memory, nothing initialised."""
    with torch.device("meta"):
        return Transformer(cfg)


def materialize(
    owner: Transformer, views: Sequence[Transformer], *, seed: int, device: torch.device
) -> None:
    """Allocate a (parallelised) skeleton's parameters on `device` and initialise them;
    `views`: modules sharing its blocks (pipeline stages), whose rope tables are reset too."""
    owner.to_empty(device=device)
    for module in (owner, *views):
        module.reset_rope(device)
    owner.init_weights(seed)


def build(cfg: recipes.ModelConfig, *, seed: int, device: torch.device) -> Transformer:
    """The full model on one device with weights that depend on `seed` only."""
    model = skeleton(cfg)
    materialize(model, [], seed=seed, device=device)
    return model


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every position of the batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
