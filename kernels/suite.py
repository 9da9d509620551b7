"""The `vigil diag` suite: which diagnostics run at --quick and --full, on which devices, in order.

Runs each diagnostic on every local device (GPUs, or the CPU where there are none), then the
node-wide ones (SDC agreement across devices, collective bus bandwidth), and judges everything
against the fleet baseline and each device's spec sheet. A diagnostic that raises is recorded as a
failed `<test>.crashed` result and the suite goes on. Knows nothing of the CLI or the collector.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vigil import schema
from vigil.kernels import (
    bandwidth,
    catalog,
    collectives,
    devices,
    gemm,
    measurement,
    memtest,
    sdc,
    spec,
    thermal,
    verdict,
)

log = logging.getLogger(__name__)

NODE_DEVICE = "node"  # DiagResult.device of node-wide tests (collectives)


class Level(enum.StrEnum):
    QUICK = "quick"  # pre-flight: a minute or less per node
    FULL = "full"  # suspect-node investigation: several minutes per node


@dataclass(frozen=True, kw_only=True)
class SuitePlan:
    gemm: gemm.GemmConfig | None = None
    bandwidth: bandwidth.BandwidthConfig | None = None
    sdc: sdc.SdcConfig | None = None
    memtest: memtest.MemtestConfig | None = None
    burn: thermal.BurnConfig | None = None
    collectives: collectives.CollectiveConfig | None = None

    def only(self, names: set[str]) -> SuitePlan:
        """This plan with just the named diagnostics (field names) left in."""
        unknown = names - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown diagnostics {sorted(unknown)}; known: {DIAGNOSTICS}")
        return dataclasses.replace(
            self, **{f.name: None for f in dataclasses.fields(self) if f.name not in names}
        )


DIAGNOSTICS = catalog.DIAGNOSTICS  # one per SuitePlan field (tests/kernels keeps them equal)


def default_plan(level: Level, *, on_gpu: bool) -> SuitePlan:
    full = level is Level.FULL
    if on_gpu:
        return SuitePlan(
            gemm=gemm.GemmConfig(
                size=8192,  # smaller GEMMs sit below the spec floors even on healthy GPUs
                dtypes=("bf16", "fp16", "fp8") if full else ("bf16",),
            ),
            bandwidth=bandwidth.BandwidthConfig(
                ops=bandwidth.STREAM_OPS if full else ("copy", "triad")
            ),
            sdc=sdc.SdcConfig(size=4096 if full else 2048, rounds=8 if full else 4),
            memtest=memtest.MemtestConfig(
                patterns=memtest.FULL_PATTERNS if full else memtest.QUICK_PATTERNS,
                walking_bits=memtest.FULL_WALKING_BITS if full else memtest.QUICK_WALKING_BITS,
            ),
            burn=thermal.BurnConfig(duration_s=30.0) if full else None,
            collectives=collectives.CollectiveConfig(
                sizes=(1 << 20, 16 << 20, 256 << 20) if full else (64 << 20,),
                ops=collectives.OPS if full else ("all_reduce",),
            ),
        )
    # CPU nodes (and CI): the same diagnostics at sizes a laptop finishes in seconds.
    return SuitePlan(
        gemm=gemm.GemmConfig(size=512 if full else 256, dtypes=("fp32",), warmup=1, iters=3),
        bandwidth=bandwidth.BandwidthConfig(
            stream_bytes=(64 if full else 16) << 20,
            host_bytes=(64 if full else 16) << 20,
            ops=bandwidth.STREAM_OPS if full else ("copy", "triad"),
            warmup=1,
            iters=3,
        ),
        sdc=sdc.SdcConfig(
            size=256 if full else 128, rounds=4 if full else 2, hash_elements=1 << 14
        ),
        memtest=memtest.MemtestConfig(
            cpu_bytes=(64 if full else 16) << 20,
            patterns=memtest.FULL_PATTERNS if full else memtest.QUICK_PATTERNS,
            walking_bits=memtest.FULL_WALKING_BITS if full else memtest.QUICK_WALKING_BITS,
        ),
        burn=thermal.BurnConfig(duration_s=5.0, size=256, dtype="fp32") if full else None,
        collectives=collectives.CollectiveConfig(
            sizes=(64 << 10, 1 << 20, 16 << 20) if full else (1 << 20,),
            ops=collectives.OPS if full else ("all_reduce",),
            warmup=1,
            iters=3,
            timeout_s=120.0,
        ),
    )


Progress = Callable[[str], None]


@dataclass(kw_only=True)
class Suite:
    plan: SuitePlan
    targets: list[devices.Target]
    fleet: verdict.FleetBaseline = field(default_factory=verdict.FleetBaseline)
    node: str = field(default_factory=socket.gethostname)
    clock: Callable[[], float] = time.time

    def steps(self) -> list[str]:
        """Names of the steps `run` reports progress for, in order."""
        per_device = [
            n for n in ("gemm", "bandwidth", "sdc", "burn", "memtest") if getattr(self.plan, n)
        ]
        names = [f"{n} {t.device_id}" for t in self.targets for n in per_device]
        if self.plan.collectives is not None:
            names.append("collectives")
        return names

    def run(self, progress: Progress = lambda _step: None) -> list[schema.DiagResult]:
        results: list[schema.DiagResult] = []
        checksums: dict[str, int] = {}
        per_device: dict[str, list[measurement.Measurement]] = {}
        for target in self.targets:
            found = per_device.setdefault(target.device_id, [])
            for name, fn in self._device_steps():
                found += _guarded(name, lambda fn=fn, t=target: fn(t, checksums))  # type: ignore[misc]
                progress(f"{name} {target.device_id}")
        disagree = set(sdc.outliers(checksums))
        for target in self.targets:
            found = per_device[target.device_id]
            if len(checksums) > 1:
                found.append(_node_agreement(target.device_id in disagree))
            results += self._judge(found, target.device_id, spec.spec_sheet(target.name))
        if self.plan.collectives is not None:
            found = _guarded("coll", self._collectives)
            results += self._judge(found, NODE_DEVICE, {})
            progress("collectives")
        return results

    def _device_steps(
        self,
    ) -> list[
        tuple[str, Callable[[devices.Target, dict[str, int]], list[measurement.Measurement]]]
    ]:
        p = self.plan
        steps: list[
            tuple[str, Callable[[devices.Target, dict[str, int]], list[measurement.Measurement]]]
        ] = []
        if p.gemm:
            cfg_g = p.gemm
            steps.append(("gemm", lambda t, _c: gemm.measurements(gemm.run(t, cfg_g))))
        if p.bandwidth:
            cfg_b = p.bandwidth
            steps.append(
                (
                    "bandwidth",
                    lambda t, _c: bandwidth.measurements(
                        bandwidth.run_stream(t, cfg_b), bandwidth.run_host(t, cfg_b)
                    ),
                )
            )
        if p.sdc:
            cfg_s = p.sdc

            def run_sdc(t: devices.Target, sums: dict[str, int]) -> list[measurement.Measurement]:
                outcome = sdc.run(t, cfg_s)
                sums[t.device_id] = outcome.checksum
                return sdc.measurements(outcome)

            steps.append(("sdc", run_sdc))
        if p.burn:
            cfg_t = p.burn
            steps.append(
                (
                    "burn",
                    lambda t, _c: thermal.measurements(
                        thermal.burn(t, cfg_t, thermal.sampler_for(t))
                    ),
                )
            )
        if p.memtest:
            cfg_m = p.memtest
            steps.append(("memtest", lambda t, _c: memtest.measurements(memtest.run(t, cfg_m))))
        return steps

    def _collectives(self) -> list[measurement.Measurement]:
        assert self.plan.collectives is not None
        gpus = [t for t in self.targets if t.is_cuda]
        if len(gpus) == 1:
            log.info("one GPU on this node: no intra-node collectives to measure")
            return []
        run = collectives.run_local(
            self.plan.collectives, world_size=len(gpus) or 2, use_cuda=bool(gpus)
        )
        return collectives.measurements(run.figures)

    def _judge(
        self,
        found: list[measurement.Measurement],
        device_id: str,
        sheet: dict[str, spec.SpecFigure],
    ) -> list[schema.DiagResult]:
        return verdict.to_results(
            found,
            node=self.node,
            device_id=device_id,
            sheet=sheet,
            fleet=self.fleet,
            time_s=self.clock(),
        )


def _node_agreement(disagrees: bool) -> measurement.Measurement:
    return measurement.Measurement(
        test="sdc.node_disagreement",
        value=1.0 if disagrees else 0.0,
        unit="count",
        kind=measurement.Kind.ERRORS,
        note="checksum differs from the other devices of this node" if disagrees else "",
    )


def _guarded(
    name: str, fn: Callable[[], list[measurement.Measurement]]
) -> list[measurement.Measurement]:
    try:
        return fn()
    except Exception as exc:  # one broken diagnostic must not hide the others' results
        log.exception("diagnostic %s crashed", name)
        return [
            measurement.Measurement(
                test=f"{name}.crashed",
                value=1.0,
                unit="count",
                kind=measurement.Kind.ERRORS,
                note=f"{type(exc).__name__}: {exc}",
            )
        ]


def run_node(
    level: Level = Level.QUICK,
    *,
    fleet: verdict.FleetBaseline | None = None,
    node: str | None = None,
    cpu: bool = False,
    only: set[str] | None = None,
) -> list[schema.DiagResult]:
    """Run the default plan on this node's devices: the in-process API for a pre-flight check or
    a suspect node's check (nothing in vigil calls it yet; `vigil diag` runs the same suite)."""
    targets = devices.local_targets(cpu=cpu)
    plan = default_plan(level, on_gpu=targets[0].is_cuda)
    runner = Suite(
        plan=plan.only(only) if only else plan,
        targets=targets,
        fleet=fleet or verdict.FleetBaseline(),
    )
    if node:
        runner.node = node
    return runner.run()


def healthy(results: list[schema.DiagResult]) -> bool:
    """True when no result is suspect or failed."""
    return not any(r.verdict in (schema.Verdict.SUSPECT, schema.Verdict.FAIL) for r in results)
