"""Typed training recipes: model shape, parallel layout and optimisation settings.

Every knob of the bundled trainer lives in one of the keyword-only dataclasses here, and each one
validates itself in `__post_init__` with a message that says what to change. Named recipes
(`tiny`, `125m`, `1b`, `8b`, `70b`) give the shapes used in tests and on GPU clusters. This module
is pure: it must not import torch.distributed or touch devices, so bad recipes fail before any
process group exists.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path
from typing import Any

from vigil import flops, schema


class DataParallel(enum.StrEnum):
    """How the data-parallel dimension keeps its replicas in step."""

    FSDP = "fsdp"  # FSDP2 fully_shard: parameters sharded over dp
    HSDP = "hsdp"  # FSDP2 on a 2-D (replicate, shard) mesh: shard inside a node, replicate across
    DDP = "ddp"  # DistributedDataParallel: full replica per rank


class PipelineSchedule(enum.StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class ActivationCheckpoint(enum.StrEnum):
    NONE = "none"
    FULL = "full"  # recompute every block in backward
    SELECTIVE = "selective"  # recompute every other block (memory/compute trade-off)


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"  # bf16 compute, fp32 master weights and fp32 gradient reduction


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT-style decoder: RMSNorm, RoPE, SwiGLU MLP, causal SDPA attention."""

    vocab_size: int = 256  # byte-level by default, so any text file is a valid corpus
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention when smaller than n_heads
    ffn_multiple_of: int = 32  # SwiGLU hidden size rounds up to this (tensor-core friendly)
    ffn_dim_multiplier: float | None = None
    max_seq_len: int = 32
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "ffn_multiple_of"):
            _positive(name, getattr(self, name))
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count of `vigil.trainer.model.Transformer` built from this config.

        `include_embedding=False` leaves out the input embedding table only; the (untied) output
        head stays, since it is a matmul per token. That is the N of `vigil.flops`.
        """
        kv = self.kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv * 2
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        embed = self.vocab_size * self.dim
        total = self.n_layers * block + self.dim + embed  # blocks, final norm, output head
        return total + embed if include_embedding else total

    def flops_per_token(self, seq_len: int) -> float:
        """Training model FLOPs per token at `seq_len`: `vigil.flops.flops_per_token` of `shape`."""
        return flops.flops_per_token(self.shape(seq_len))

    def shape(self, seq_len: int) -> schema.ModelShape:
        """The shape the SDK's MFU accounting takes; params is N (no input embedding table)."""
        return schema.ModelShape(
            params=self.num_params(include_embedding=False),
            layers=self.n_layers,
            hidden=self.dim,
            heads=self.n_heads,
            seq_len=seq_len,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Sizes of the mesh dimensions (pp, dp_replicate, dp, tp) and how each is run."""

    dp: int = 1  # data-parallel size (the shard dimension for FSDP/HSDP)
    dp_replicate: int = 1  # HSDP only: number of replica groups
    tp: int = 1
    pp: int = 1
    data_parallel: DataParallel = DataParallel.FSDP
    sequence_parallel: bool = True  # shard norms/activations over the sequence under TP
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    stages_per_rank: int = 1  # >1 only with interleaved 1F1B (virtual stages)
    microbatches: int = 0  # pipeline microbatches; 0 means 2 x pp

    def __post_init__(self) -> None:
        for name in ("dp", "dp_replicate", "tp", "pp", "stages_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_replicate > 1 and self.data_parallel is not DataParallel.HSDP:
            raise ValueError("dp_replicate > 1 needs data_parallel='hsdp'; set --dp-mode hsdp")
        if self.data_parallel is DataParallel.DDP and (self.tp > 1 or self.pp > 1):
            raise ValueError(
                "DDP combines with neither tp nor pp here; use data_parallel='fsdp' for dpxtp/dpxpp"
            )
        interleaved = self.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B
        if self.stages_per_rank > 1 and not interleaved:
            raise ValueError("stages_per_rank > 1 needs pipeline_schedule='interleaved_1f1b'")
        if interleaved and self.pp > 1 and self.stages_per_rank < 2:
            raise ValueError("interleaved_1f1b needs stages_per_rank >= 2 (virtual stages)")
        if self.microbatches < 0:
            raise ValueError(f"parallel.microbatches must be >= 0, got {self.microbatches}")
        if interleaved and self.num_microbatches % self.pp:
            raise ValueError(
                f"interleaved_1f1b needs microbatches ({self.num_microbatches}) divisible by "
                f"pp ({self.pp})"
            )

    @property
    def dp_total(self) -> int:
        """Number of data-parallel replicas of a batch (shard x replicate)."""
        return self.dp * self.dp_replicate

    @property
    def world_size(self) -> int:
        return self.dp_total * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    def layout(self) -> schema.ParallelLayout:
        return schema.ParallelLayout(dp=self.dp_total, tp=self.tp, pp=self.pp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int = 2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("warmup_steps, weight_decay and grad_clip must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    seed: int = 1234
    text_path: Path | None = None  # a local text file read byte by byte; None = synthetic stream
    stall_s: float = 0.0  # not a fault: fixed extra latency per batch (slow storage emulation)

    def __post_init__(self) -> None:
        if self.text_path is not None and not Path(self.text_path).is_file():
            raise ValueError(f"text file {self.text_path} does not exist; pass an existing file")
        if self.stall_s < 0:
            raise ValueError("stall_s must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    directory: Path | None = None  # None disables checkpointing and resume
    interval_steps: int = 0  # save every N steps; 0 = only at the end and on request
    keep_last: int = 3  # committed checkpoints kept; older ones are deleted
    async_save: bool = True  # DCP async_save: training continues while the copy is written
    resume: bool = True  # resume from the newest committed checkpoint in `directory`

    def __post_init__(self) -> None:
        if self.interval_steps < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {self.interval_steps}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything one training run needs; `validate_world` checks it against the launch."""

    name: str = "tiny"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    steps: int = 20
    global_batch: int = 8  # sequences per optimizer step, across all data-parallel ranks
    micro_batch: int = 0  # sequences per forward on one rank; 0 = the whole local batch
    seq_len: int = 32
    precision: Precision = Precision.FP32
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.NONE
    compile: bool = False  # torch.compile each block (GPU recipes)
    log_every: int = 1

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        _positive("seq_len", self.seq_len)
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
            )
        self._check_divisibility()

    def _check_divisibility(self) -> None:
        par, model = self.parallel, self.model
        if model.n_heads % par.tp or model.kv_heads % par.tp:
            raise ValueError(
                f"tp={par.tp} must divide n_heads ({model.n_heads}) and n_kv_heads "
                f"({model.kv_heads}); pick tp from the divisors of the head count"
            )
        if model.ffn_dim % par.tp:
            raise ValueError(f"tp={par.tp} must divide the SwiGLU hidden size ({model.ffn_dim})")
        if par.tp > 1 and par.sequence_parallel and self.seq_len % par.tp:
            raise ValueError(
                f"sequence parallel needs seq_len ({self.seq_len}) divisible by tp={par.tp}"
            )
        stages = par.pp * par.stages_per_rank
        if stages > model.n_layers:
            raise ValueError(
                f"{stages} pipeline stages need at least that many layers (have {model.n_layers})"
            )
        if self.global_batch % par.dp_total:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be divisible by the data-parallel "
                f"size ({par.dp_total})"
            )
        local = self.local_batch
        if self.micro_batch and local % self.micro_batch:
            raise ValueError(
                f"micro_batch ({self.micro_batch}) must divide the per-rank batch ({local})"
            )
        if par.pp > 1 and local % par.num_microbatches:
            raise ValueError(
                f"the per-rank batch ({local}) must be divisible by the {par.num_microbatches} "
                "pipeline microbatches; change global_batch or --microbatches"
            )

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.parallel.dp_total

    @property
    def accumulation_steps(self) -> int:
        """Gradient-accumulation steps per optimizer step (1 under pipeline parallelism)."""
        if self.parallel.pp > 1 or not self.micro_batch:
            return 1
        return self.local_batch // self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def validate_world(self, world_size: int) -> None:
        """Fail at start, before any collective, when the launch does not match the mesh."""
        want = self.parallel.world_size
        if world_size != want:
            p = self.parallel
            raise ValueError(
                f"world size {world_size} does not match the mesh dp_replicatexdpxtpxpp = "
                f"{p.dp_replicate}x{p.dp}x{p.tp}x{p.pp} = {want}; launch {want} processes or "
                "change --dp/--tp/--pp"
            )

    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)


_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    # GPT-3 small / 125M-class shape (vocab of a BPE tokenizer).
    "125m": ModelConfig(vocab_size=32_000, dim=768, n_layers=12, n_heads=12, max_seq_len=2048),
    # Llama-3.2-1B-like: 16 layers, GQA 32/8, 8K-wide SwiGLU.
    "1b": ModelConfig(
        vocab_size=128_256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_multiple_of=1024,
        ffn_dim_multiplier=1.5,
        max_seq_len=8192,
        rope_theta=500_000.0,
    ),
    "8b": ModelConfig(
        vocab_size=128_256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_multiple_of=1024,
        ffn_dim_multiplier=1.3,
        max_seq_len=8192,
        rope_theta=500_000.0,
    ),
    "70b": ModelConfig(
        vocab_size=128_256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_multiple_of=4096,
        ffn_dim_multiplier=1.3,
        max_seq_len=8192,
        rope_theta=500_000.0,
    ),
}

_GPU_DEFAULTS: dict[str, Any] = {
    "precision": Precision.BF16,
    "activation_checkpoint": ActivationCheckpoint.SELECTIVE,
    "optim": OptimConfig(lr=3e-4, warmup_steps=20),
}


def recipe_names() -> list[str]:
    return list(_SHAPES)


def named(name: str, **overrides: Any) -> Recipe:
    """The recipe called `name` with keyword overrides applied (validated once, at the end)."""
    if name not in _SHAPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(_SHAPES)}")
    base: dict[str, Any] = {"name": name, "model": _SHAPES[name]}
    if name == "tiny":
        base.update(steps=20, global_batch=8, seq_len=32, optim=OptimConfig(lr=1e-2))
    else:
        base.update(_GPU_DEFAULTS, steps=100, global_batch=8, seq_len=2048, compile=True)
        if name in ("1b", "8b"):
            base["seq_len"] = 8192 if name == "8b" else 4096
            base["global_batch"] = 4 if name == "1b" else 2
    base.update(overrides)
    return Recipe(**base)
