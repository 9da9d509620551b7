"""The model shape MFU needs, read from a Hugging Face model and its config.

`model_shape(model, seq_len)` returns the `vigil.schema.ModelShape` that `vigil.flops` turns
into model FLOPs per token (6·N + 12·L·H·Q·T): N counts every parameter except the embedding
tables a token only looks up (token, learned position and token-type embeddings), the output head
included (counted once when it shares its weight with the input embedding); L, hidden size and
heads come from the config (`num_hidden_layers`, `hidden_size`, `num_attention_heads`, which
transformers maps onto GPT-2's `n_layer`/`n_embd`/`n_head` too), T is the training sequence
length. `train_seq_len` works T out when the user did not give it.

Pure reads of the model and its dataset: no torch.distributed, no vigil session.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vigil import schema

log = logging.getLogger(__name__)


def _config_int(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    if callable(getter):  # multimodal models keep the language model's sizes in a sub-config
        try:
            return getter()
        except Exception:  # an odd config: use it as it is
            return config
    return config


def _lookup_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every embedding table's weight except one the output head also uses (tied weights)."""
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        head_module = get_head()
        head = getattr(head_module, "weight", None)
    tables: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.weight is not head:
            tables[id(module.weight)] = module.weight
    return list(tables.values())


def model_shape(model: torch.nn.Module, seq_len: int) -> schema.ModelShape | None:
    """The shape of `model` trained on sequences of `seq_len` tokens; None without parameters.

    Counts global sizes: a sharded parameter (FSDP2's DTensor) reports its full shape."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    lookups = sum(p.numel() for p in _lookup_tables(model) if id(p) in params)
    non_embedding = total - lookups
    if non_embedding <= 0:
        return None
    config = _text_config(model)
    return schema.ModelShape(
        params=non_embedding,
        layers=_config_int(config, "num_hidden_layers", "n_layer", "num_layers"),
        hidden=_config_int(config, "hidden_size", "n_embd", "d_model"),
        heads=_config_int(config, "num_attention_heads", "n_head"),
        seq_len=max(0, int(seq_len)),
    )


def train_seq_len(model: torch.nn.Module, dataloader: Any) -> int:
    """The training sequence length: the first training sample's `input_ids` length when the
    dataset can be indexed, else the config's maximum positions (an upper bound), else 0."""
    dataset = getattr(dataloader, "dataset", None)
    try:
        sample = dataset[0] if dataset is not None and hasattr(dataset, "__getitem__") else None
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        if ids is not None and len(ids) > 0:
            return len(ids)
    except Exception as exc:  # any dataset: the config's bound is the fallback
        log.debug("cannot read a training sample's length: %r", exc)
    config = _text_config(model)
    longest = _config_int(config, "max_position_embeddings", "n_positions", "n_ctx")
    if longest:
        log.info(
            "vigil: training sequence length taken as the model's maximum, %d "
            "(pass VigilCallback(seq_len=...) for the length you train on)",
            longest,
        )
    return longest
