"""A throwaway PostgreSQL cluster: initdb + pg_ctl in a temp dir, on a loopback port.

For tests, benchmarks and demos that need a real PostgreSQL without an installed service.
PostgreSQL refuses to run as root, so the binaries run under `runuser -u postgres` when the caller
is root (CI is). The cluster trusts loopback connections and, by default, runs with fsync off: it
holds throwaway data only. Must not be used for a production store.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg

START_TIMEOUT_S = 60


def find_bin_dir() -> Path:
    """The newest PostgreSQL server's bin directory (Debian: /usr/lib/postgresql/<v>/bin)."""
    found = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1]
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise RuntimeError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found: run scripts/setup.sh, which "
        "installs the Debian package 'postgresql'"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@dataclass
class PostgresServer:
    base: Path
    port: int
    bin_dir: Path

    @property
    def admin_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=10"

    def new_database(self) -> str:
        """A fresh empty database; returns its SQLAlchemy URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run(
            _as_postgres(
                [
                    str(self.bin_dir / "pg_ctl"),
                    "-D",
                    str(self.base / "data"),
                    "-m",
                    "immediate",
                    "stop",
                ]
            ),
            capture_output=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
        shutil.rmtree(self.base, ignore_errors=True)


def start(*, durable: bool = False) -> PostgresServer:
    """Start a cluster; `durable=True` keeps PostgreSQL's fsync defaults (for benchmarks)."""
    bin_dir = find_bin_dir()
    base = Path(tempfile.mkdtemp(prefix="vigil-pg-"))
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    data = base / "data"
    subprocess.run(
        _as_postgres(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        ),
        check=True,
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    port = _free_port()
    options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1"
    if not durable:
        options += " -c fsync=off -c full_page_writes=off"
    done = subprocess.run(
        _as_postgres(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(base / "server.log"),
                "-o",
                options,
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "start",
            ]
        ),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S + 10,
        check=False,
    )
    if done.returncode != 0:
        log = (base / "server.log").read_text() if (base / "server.log").exists() else ""
        raise RuntimeError(f"pg_ctl start failed: {done.stderr}\n{log}")
    return PostgresServer(base=base, port=port, bin_dir=bin_dir)
