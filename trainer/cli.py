"""`vigil train`: the bundled trainer's command line (also `python -m vigil.trainer`).

Under torchrun (or vigil's supervisor) each rank runs this command; with `--nproc N` it launches
N local ranks itself (see `launch`). Flags override the named recipe; bad combinations fail here,
before any process group exists, with a message that says what to change (counts below 1, an
unwritable `--ckpt-dir`, a malformed `--collector`). Without `--job` each run gets a fresh job
name (see `job_name`), printed at start. Exit codes are `exits.ExitCode`. Besides those one-line
messages, output to the terminal goes through logging; this module holds no training logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vigil import cli
from vigil.cli import Command
from vigil.env import EnvVar
from vigil.trainer import launch, recipes
from vigil.trainer.exits import ExitCode

if TYPE_CHECKING:
    from vigil.trainer.runtime import RunOptions

log = logging.getLogger(__name__)
# torchrun's rendezvous id, the same on every rank of one run ("none" when not given).
_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    count, count0 = cli.positive_int, cli.non_negative_int  # >= 1; >= 0 where 0 is a default
    add("--recipe", default="tiny", choices=recipes.recipe_names(), help="model/batch preset")
    add("--steps", type=count, help="optimizer steps to train to")
    add("--dim", type=count, help="model width (overrides the recipe's)")
    add("--layers", type=count, help="number of transformer blocks")
    add("--heads", type=count, help="attention heads (and key/value heads)")
    add("--stop-after", type=count, help="stop (with a checkpoint) after this step; for tests")
    add("--dp", type=count, help="data-parallel (shard) size")
    add("--dp-replicate", type=count, help="HSDP replica groups")
    add("--tp", type=count, help="tensor-parallel size")
    add("--pp", type=count, help="pipeline-parallel size")
    add("--dp-mode", choices=[m.value for m in recipes.DataParallel], help="fsdp, hsdp or ddp")
    add("--pp-schedule", choices=[s.value for s in recipes.PipelineSchedule])
    add("--stages-per-rank", type=count, help="virtual pipeline stages per rank (interleaved)")
    add("--microbatches", type=count0, help="pipeline microbatches (default or 0: 2 x pp)")
    add("--no-sequence-parallel", action="store_true", help="keep activations replicated in TP")
    add("--global-batch", type=count, help="sequences per step across all dp ranks")
    add("--micro-batch", type=count0, help="sequences per forward (0: the whole local batch)")
    add("--seq-len", type=count)
    add("--precision", choices=[p.value for p in recipes.Precision])
    add("--ac", choices=[a.value for a in recipes.ActivationCheckpoint], help="activation ckpt")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile each block")
    add("--lr", type=cli.positive_float)
    add("--seed", type=int)
    add("--text", type=Path, help="train on this text file, byte by byte (vocab 256)")
    add("--ckpt-dir", type=Path, help="checkpoint directory (enables save and resume)")
    add("--ckpt-every", type=count0, help="save every N steps (0: only at the end)")
    add("--keep-last", type=count, help="committed checkpoints to keep")
    add("--sync-save", action="store_true", help="block training while saving")
    add("--no-resume", action="store_true", help="ignore existing checkpoints")
    add("--faults", default="", help="fault spec, e.g. 'crash:rank=1,step=5' (or VIGIL_FAULTS)")
    add("--metrics-out", type=Path, help="rank 0 appends one JSON line per step here")
    add("--peak-flops", type=cli.positive_float, help="per-device peak FLOP/s for MFU")
    add("--cpu", action="store_true", help="train on CPU even when CUDA is present")
    add("--cpu-threads", type=count, help="intra-op threads per CPU rank (default cores/ranks)")
    add("--timeout", type=cli.positive_float, default=300.0, help="collective timeout (seconds)")
    add(
        "--job",
        default=None,
        help="job id reported to vigil (default: VIGIL_JOB under `vigil run`, else a fresh "
        "vigil-train-<UTC time>-<random> per run, printed at start)",
    )
    add("--collector", type=cli.collector_url, help="collector URL (else VIGIL_COLLECTOR_URL)")
    add("--output-dir", type=Path, help="SDK JSONL output directory (else VIGIL_OUTPUT_DIR)")
    add("--no-telemetry", action="store_true", help="do not initialise the vigil SDK")
    add("--nproc", type=count, help="launch this many local ranks (no torchrun)")


def job_name(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The job this run reports under; the same on every rank. ValueError when ranks can't agree.

    `--job` wins, then VIGIL_JOB (set by `vigil run` for all its ranks). A single process or the
    `--nproc` launcher (which hands its choice to its ranks) gets a fresh name per run, so a
    second run never writes over the first one's steps. Ranks of another launcher share only
    what it tells them: torchrun's rendezvous id, when it has one.
    """
    if args.job:
        return str(args.job)
    if environ.get(EnvVar.JOB):
        return environ[EnvVar.JOB]
    world = environ.get("WORLD_SIZE", "1")
    if args.nproc is None and world.isdigit() and int(world) > 1 and not args.no_telemetry:
        run_id = environ.get(_RUN_ID_ENV, "none")
        if run_id and run_id != "none":
            return f"vigil-train-{run_id}"
        raise ValueError(
            f"the {world} ranks of this launch need one job name to report under: pass "
            f"--job NAME (or set {EnvVar.JOB}, or give torchrun --rdzv-id / --standalone)"
        )
    return cli.unique_job_name("vigil-train")


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


def options_from_args(args: argparse.Namespace, *, job: str) -> RunOptions:
    from vigil.trainer.runtime import RunOptions

    return RunOptions(
        job_id=job,
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
        job = job_name(args, os.environ)
        recipe = recipe_from_args(args)
        options = options_from_args(args, job=job)
        faults.parse(options.faults_spec or os.environ.get(EnvVar.FAULTS, ""))
        launching = args.nproc is not None
        env = None if launching else runtime.LaunchEnv.from_env()
        recipe.validate_world(args.nproc if env is None else env.world_size)
        if recipe.checkpoint.directory is not None:
            _check_ckpt_dir(recipe.checkpoint.directory)
    except ValueError as exc:
        sys.stderr.write(f"vigil train: {exc}\n")
        return int(ExitCode.BAD_CONFIG)
    if args.job is None and os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"vigil train: job {job}\n")
    if launching:
        child = launch.child_argv(sys.argv[1:])
        return launch.launch_local(args.nproc, child if args.job else [*child, "--job", job])
    try:
        return runtime.run(recipe, options, env)
    except Exception:
        log.exception("training failed")
        logging.shutdown()
        os._exit(int(ExitCode.FAILED))  # peers may be gone: skip teardown that could block


def _check_ckpt_dir(path: Path) -> None:
    """Before any training: a checkpoint folder that cannot take files fails now, not at the end."""
    try:
        cli.ensure_writable_dir(path)
    except ValueError as exc:
        raise ValueError(f"--ckpt-dir: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m vigil.trainer`: the same command without the `vigil` wrapper."""
    from vigil import logs, settings

    parser = cli.ArgumentParser(prog="python -m vigil.trainer", description=train_command.help)
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
