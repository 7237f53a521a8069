"""A one-node Slurm cluster on 127.0.0.1 for tests and for trying `--launcher slurm` by hand: munged,
slurmctld and slurmd in the foreground, all state under one temp folder, ports picked free.

By hand: `make slurm-local` (as root) starts it, prints the `export SLURM_CONF=...` line to paste into
another shell, and runs until Ctrl-C or SIGTERM, which cancel every job and stop the three daemons.

`SlurmCluster(base).start()` returns the cluster or raises ClusterUnavailable with the reason (no
Slurm installed, not root, a daemon that would not start); `stop()` cancels every job, waits for
their steps to end, then stops the daemons by PID. Every client call needs `cluster.env`
(SLURM_CONF).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.ports import server_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
CPUS = 8  # more than the 2 real cores (config_overrides): worker jobs and trial jobs fit side by side


class ClusterUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why (tests skip with it)."""


def _slurm_conf(base: Path, host: str, munge_socket: Path) -> str:
    ctld, slurmd = server_port(), server_port()
    return f"""ClusterName=workbench
SlurmctldHost={host}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
SlurmctldPort={ctld}
SlurmdPort={slurmd}
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=500
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MinJobAge=300
KillWait=5
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self.conf = self.base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def _run(self, *cmd: str, timeout: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)

    def _daemon(self, *cmd: str, log: str) -> subprocess.Popen:
        out = open(self.base / log, "w")
        proc = subprocess.Popen(list(cmd), env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def _wait(self, what: str, ready, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            if ready():
                return
            time.sleep(0.1)
        logs = " | ".join(p.read_text(errors="replace")[-400:] for p in self.base.glob("*.log"))
        raise ClusterUnavailable(f"{what} did not come up within {timeout:.0f} s: {logs}")

    def _start_munge(self) -> Path:
        munge = self.base / "munge"
        for sub in ("etc", "lib", "run"):
            (munge / sub).mkdir(parents=True, exist_ok=True)
        for p in (self.base, munge, munge / "run"):  # munged refuses a socket dir any parent of which lacks o+x
            p.chmod(0o755)
        for p in (munge / "etc", munge / "lib"):
            p.chmod(0o700)
        key = munge / "etc" / "munge.key"
        made = self._run("mungekey", "-c", "-k", str(key))
        if made.returncode:
            raise ClusterUnavailable(f"mungekey failed: {made.stderr.strip()}")
        sock = munge / "run" / "munge.socket.2"
        self._daemon("munged", "-F", f"--key-file={key}", f"--socket={sock}", f"--pid-file={munge}/run/munged.pid",
                     f"--log-file={munge}/munged.log", f"--seed-file={munge}/lib/munged.seed", log="munged.out")
        self._wait("munged", sock.exists)
        return sock

    def start(self) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; on any failure stop what started and raise ClusterUnavailable."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> SlurmCluster:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise ClusterUnavailable(f"Slurm/munge not installed (missing {', '.join(missing)}); "
                                     "`make test` installs them with apt-get")
        if os.geteuid() != 0:
            raise ClusterUnavailable("the test cluster runs its daemons as root (SlurmUser=root); not root here")
        self.base.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool"):
            (self.base / sub).mkdir(exist_ok=True)
        host = socket.gethostname().split(".")[0]
        sock = self._start_munge()
        self.conf.write_text(_slurm_conf(self.base, host, sock))
        self._daemon("slurmctld", "-D", "-c", "-f", str(self.conf), log="slurmctld.out")
        self._wait("slurmctld", lambda: "UP" in self._run("scontrol", "ping").stdout)
        self._daemon("slurmd", "-D", "-f", str(self.conf), log="slurmd.out")
        self._wait("slurmd", lambda: self._run("sinfo", "-h", "-o", "%t").stdout.strip() == "idle")
        return self

    def active_jobs(self) -> list[str]:
        out = self._run("squeue", "-h", "-t", "PD,R,CG,S", "-o", "%i").stdout
        return out.split()

    def stop(self) -> None:
        try:
            if self.active_jobs():
                self._run("scancel", "--full", *self.active_jobs())
                deadline = time.time() + 30
                while self.active_jobs() and time.time() < deadline:  # job steps outlive slurmd
                    time.sleep(0.2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self.procs.clear()
        self._kill_job_processes()

    def _kill_job_processes(self) -> None:
        """Kill and wait for what this cluster's jobs left: on a loaded machine a job's process (a
        `sleep 300` in CI) outlived scancel, squeue and slurmd. A process is this cluster's when its
        SLURM_CONF is this conf and it is a job's (SLURM_JOB_ID) or a slurmstepd."""
        import psutil

        left = []
        for proc in psutil.process_iter(["name"]):
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("SLURM_CONF") == str(self.conf) and ("SLURM_JOB_ID" in env or proc.info["name"] == "slurmstepd"):
                left.append(proc)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=10)


class _Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP asked the cluster to stop."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def main(argv: list[str]) -> int:
    """Run a cluster until a signal (or `argv[0]` seconds); every daemon and job is gone on return."""
    import signal
    import tempfile

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    base = Path(tempfile.mkdtemp(prefix="slurm-"))
    cluster = SlurmCluster(base)
    try:
        cluster.start()
        print(f"A one-node Slurm cluster runs ({CPUS} CPUs, partition debug, state in {base}).\n"
              f"In another shell:\n  export SLURM_CONF={cluster.conf}\n"
              "  workbench run examples/tiny.yaml --launcher slurm\n  sinfo; squeue -t all\n"
              "Ctrl-C here stops it (every job cancelled, munged/slurmctld/slurmd stopped).", flush=True)
        deadline = time.time() + (float(argv[0]) if argv else float("inf"))
        while time.time() < deadline and all(p.poll() is None for p in cluster.procs):
            time.sleep(0.5)
        return 0 if time.time() >= deadline else 1
    except ClusterUnavailable as exc:
        print(f"cannot start the cluster: {exc}", flush=True)
        return 2
    except _Stop:
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
        print("stopped: no job, no daemon left", flush=True)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
