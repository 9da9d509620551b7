"""Model FLOPs per token of a decoder-only transformer: the one definition vigil uses.

Both the SDK (`vigil.agent.mfu`, from the `ModelShape` a training script passes) and the bundled
trainer (`vigil.trainer.recipes.ModelConfig.flops_per_token`) call `flops_per_token` here, so a
trainer's MFU and the SDK's MFU for the same model cannot disagree. Pure arithmetic, no imports
beyond the schema.

The formula is PaLM's (Chowdhery et al. 2022, appendix B), the one Megatron-LM and torchtitan use:

    model FLOPs per token = 6·N + 12·L·H·Q·T

- **6·N**: every weight matrix W (a by b) a token meets costs 2ab FLOPs forward (one multiply
  and one add per weight), and 4ab backward (the input gradient and the weight gradient, one matmul
  each): 6 FLOPs per parameter per token.
- **N counts every parameter except the input embedding tables.** An embedding lookup is a row
  gather: no FLOPs forward, and its backward is a scatter-add of hidden-size rows, nowhere near 6
  FLOPs per table entry. Counting the table would credit 6·vocab·hidden FLOPs per token that never
  run: +7% on the trainer's Llama-3-8B-like recipe, +22% on its 125M one (32K vocabulary). The
  output head (logits = h·W_out, hidden by vocab) is a real matmul per token and IS counted.
  With tied weights the shared table is one tensor doing one matmul (as the head), so it counts
  once; untied, the input copy is left out. Learned position-embedding tables are lookups too and
  are left out (RoPE has no parameters). Norm gains and biases stay in N by convention: they cost
  a few FLOPs each, not 6, but they are a negligible share (about 2·L·hidden).
- **12·L·H·Q·T**: attention's two matmuls that involve no parameters. Per layer and token, the
  query (H heads · Q head dim = hidden) meets T keys in QKᵀ (2·T·H·Q FLOPs) and the scores meet T
  values (2·T·H·Q): 4·T·H·Q forward, twice that backward. T is the training sequence length. As in
  PaLM and torchtitan the causal mask's skipped half is not subtracted, and recomputation
  (activation checkpointing, flash attention's backward) is not added: these are model FLOPs, the
  work the model needs, not hardware FLOPs. Grouped-query attention shares K/V heads, but the
  scores are still computed per query head, so H·Q is the full hidden size; the smaller K/V
  projections show up in N.

A `ModelShape` maps onto it as N = `params`, L = `layers`, H·Q = `hidden`, T = `seq_len`.
"""

from __future__ import annotations

from vigil import schema


def flops_per_token(shape: schema.ModelShape) -> float:
    """Training model FLOPs per token of `shape`: 6·N + 12·L·H·Q·T (see the module docstring).

    `shape.params` is N: all parameters except the input embedding table(s), output head included.
    A shape without layers, hidden or seq_len gets the 6·N term only.
    """
    if shape.params <= 0:
        raise ValueError("model shape needs params > 0 to estimate FLOPs per token")
    return 6.0 * shape.params + 12.0 * shape.layers * shape.hidden * shape.seq_len
