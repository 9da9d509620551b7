"""`vigil train`: the bundled trainer's command line (also `python -m vigil.trainer`).

Under torchrun (or vigil's supervisor) each rank runs this command; with `--nproc N` it launches
N local ranks itself (see `launch`). Flags override the named recipe; bad combinations fail here,
before any process group exists, with a message that says what to change. Exit codes are
`exits.ExitCode`. Output to the terminal goes through logging; this module holds no training logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vigil.cli import Command
from vigil.env import EnvVar
from vigil.trainer import launch, recipes
from vigil.trainer.exits import ExitCode

if TYPE_CHECKING:
    from vigil.trainer.runtime import RunOptions

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--recipe", default="tiny", choices=recipes.recipe_names(), help="model/batch preset")
    add("--steps", type=int, help="optimizer steps to train to")
    add("--dim", type=int, help="model width (overrides the recipe's)")
    add("--layers", type=int, help="number of transformer blocks")
    add("--heads", type=int, help="attention heads (and key/value heads)")
    add("--stop-after", type=int, help="stop (with a checkpoint) after this step; for tests")
    add("--dp", type=int, help="data-parallel (shard) size")
    add("--dp-replicate", type=int, help="HSDP replica groups")
    add("--tp", type=int, help="tensor-parallel size")
    add("--pp", type=int, help="pipeline-parallel size")
    add("--dp-mode", choices=[m.value for m in recipes.DataParallel], help="fsdp, hsdp or ddp")
    add("--pp-schedule", choices=[s.value for s in recipes.PipelineSchedule])
    add("--stages-per-rank", type=int, help="virtual pipeline stages per rank (interleaved)")
    add("--microbatches", type=int, help="pipeline microbatches (default 2 x pp)")
    add("--no-sequence-parallel", action="store_true", help="keep activations replicated in TP")
    add("--global-batch", type=int, help="sequences per step across all dp ranks")
    add("--micro-batch", type=int, help="sequences per forward (gradient accumulation)")
    add("--seq-len", type=int)
    add("--precision", choices=[p.value for p in recipes.Precision])
    add("--ac", choices=[a.value for a in recipes.ActivationCheckpoint], help="activation ckpt")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile each block")
    add("--lr", type=float)
    add("--seed", type=int)
    add("--text", type=Path, help="train on this text file, byte by byte (vocab 256)")
    add("--ckpt-dir", type=Path, help="checkpoint directory (enables save and resume)")
    add("--ckpt-every", type=int, help="save every N steps")
    add("--keep-last", type=int, help="committed checkpoints to keep")
    add("--sync-save", action="store_true", help="block training while saving")
    add("--no-resume", action="store_true", help="ignore existing checkpoints")
    add("--faults", default="", help="fault spec, e.g. 'crash:rank=1,step=5' (or VIGIL_FAULTS)")
    add("--metrics-out", type=Path, help="rank 0 appends one JSON line per step here")
    add("--peak-flops", type=float, help="per-device peak FLOP/s for MFU (GPU table otherwise)")
    add("--cpu", action="store_true", help="train on CPU even when CUDA is present")
    add("--cpu-threads", type=int, help="intra-op threads per CPU rank (default cores/ranks)")
    add("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    add("--job", default="vigil-train", help="job id reported to vigil")
    add("--collector", help="collector URL for the SDK (else VIGIL_COLLECTOR_URL)")
    add("--output-dir", type=Path, help="SDK JSONL output directory (else VIGIL_OUTPUT_DIR)")
    add("--no-telemetry", action="store_true", help="do not initialise the vigil SDK")
    add("--nproc", type=int, default=0, help="launch this many local ranks (no torchrun)")


def _set(target: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        target[key] = value


def recipe_from_args(args: argparse.Namespace) -> recipes.Recipe:
    """The named recipe with the command line's overrides; raises ValueError when invalid."""
    base = recipes.named(args.recipe)
    par: dict[str, Any] = {}
    for key, attr in (("dp", "dp"), ("dp_replicate", "dp_replicate"), ("tp", "tp"), ("pp", "pp")):
        _set(par, key, getattr(args, attr))
    _set(par, "stages_per_rank", args.stages_per_rank)
    _set(par, "microbatches", args.microbatches)
    if args.dp_mode:
        par["data_parallel"] = recipes.DataParallel(args.dp_mode)
    if args.pp_schedule:
        par["pipeline_schedule"] = recipes.PipelineSchedule(args.pp_schedule)
    if args.no_sequence_parallel:
        par["sequence_parallel"] = False
    ckpt: dict[str, Any] = {}
    _set(ckpt, "directory", args.ckpt_dir)
    _set(ckpt, "interval_steps", args.ckpt_every)
    _set(ckpt, "keep_last", args.keep_last)
    if args.sync_save:
        ckpt["async_save"] = False
    if args.no_resume:
        ckpt["resume"] = False
    top: dict[str, Any] = {
        "parallel": dataclasses.replace(base.parallel, **par),
        "checkpoint": dataclasses.replace(base.checkpoint, **ckpt),
    }
    for key in ("steps", "global_batch", "micro_batch", "seq_len", "compile"):
        _set(top, key, getattr(args, key))
    if args.precision:
        top["precision"] = recipes.Precision(args.precision)
    if args.ac:
        top["activation_checkpoint"] = recipes.ActivationCheckpoint(args.ac)
    if args.lr is not None:
        top["optim"] = dataclasses.replace(base.optim, lr=args.lr)
    data: dict[str, Any] = {}
    _set(data, "seed", args.seed)
    _set(data, "text_path", args.text)
    if data:
        top["data"] = dataclasses.replace(base.data, **data)
    model: dict[str, Any] = {}
    _set(model, "dim", args.dim)
    _set(model, "n_layers", args.layers)
    if args.heads is not None:
        model.update(n_heads=args.heads, n_kv_heads=None)
    if args.seq_len is not None and args.seq_len > base.model.max_seq_len:
        model["max_seq_len"] = args.seq_len  # RoPE tables only: no parameters change
    if args.text is not None and base.model.vocab_size < 256:
        model["vocab_size"] = 256
    if model:
        top["model"] = dataclasses.replace(base.model, **model)
    return base.replace(**top)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    from vigil.trainer.runtime import RunOptions

    return RunOptions(
        job_id=args.job,
        force_cpu=args.cpu,
        cpu_threads=args.cpu_threads,
        collective_timeout_s=args.timeout,
        faults_spec=args.faults,
        metrics_path=args.metrics_out,
        peak_flops=args.peak_flops,
        telemetry=not args.no_telemetry,
        collector=args.collector,
        output_dir=args.output_dir,
        stop_after=args.stop_after,
    )


def run(args: argparse.Namespace) -> int:
    # torch loads here, not at import: `vigil --help` and other subcommands stay fast.
    from vigil.trainer import faults, runtime

    try:
        recipe = recipe_from_args(args)
        options = options_from_args(args)
        faults.parse(options.faults_spec or os.environ.get(EnvVar.FAULTS, ""))
        if args.nproc:
            recipe.validate_world(args.nproc)
        env = runtime.LaunchEnv.from_env() if not args.nproc else None
        if env is not None:
            recipe.validate_world(env.world_size)
    except ValueError as exc:
        sys.stderr.write(f"vigil train: {exc}\n")
        return int(ExitCode.BAD_CONFIG)
    if args.nproc:
        return launch.launch_local(args.nproc, launch.child_argv(sys.argv[1:]))
    try:
        return runtime.run(recipe, options, env)
    except Exception:
        log.exception("training failed")
        logging.shutdown()
        os._exit(int(ExitCode.FAILED))  # peers may be gone: skip teardown that could block


def main(argv: list[str] | None = None) -> int:
    """`python -m vigil.trainer`: the same command without the `vigil` wrapper."""
    from vigil import logs, settings

    parser = argparse.ArgumentParser(prog="python -m vigil.trainer", description=train_command.help)
    configure(parser)
    args = parser.parse_args(argv)
    common = settings.CommonSettings()
    logs.configure(common.log_level, common.log_format)
    return run(args)


train_command = Command(
    name="train",
    help="train the bundled GPT-style model (DDP/FSDP/TP/PP on one DeviceMesh)",
    configure=configure,
    run=run,
)
