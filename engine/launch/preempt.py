"""Checkpoint on Slurm's warning signal and resume after the requeue.

A Slurm job asks for SIGUSR1 `cluster.signal_s` seconds before its time limit (`--signal=USR1@S`;
a preemption or `scancel --signal=USR1` sends the same). Every rank sets a flag in its handler; at
the next step boundary the ranks agree on it (one MAX all-reduce of one integer on the host group,
so all of them stop at the same step), write a checkpoint of the steps done, rank 0 leaves the
`requeue` marker in the run folder, and the ranks exit cleanly. The batch script then runs
`scontrol requeue` for its own job; when the job starts again, `resume_point` hands the newest
checkpoint to the trainer, which continues at the step after the last one done, nothing lost.

`python -m engine.launch.preempt CMD ...` runs CMD with SIGUSR1 ignored: srun starts torchrun through it,
because Slurm signals every process of the step and torchrun has no handler for SIGUSR1 (its default
action ends the process, and with it the ranks). The ranks install their own handler over it.
"""
from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

ENV = "WORKBENCH_PREEMPTIBLE"  # set to 1 by the Slurm launcher when the job asks for the signal
MARKER = "requeue"  # the run folder's file that tells the batch script to requeue the job


class Preempted(Exception):
    """Slurm's warning signal arrived; the ranks checkpointed at `step` and leave for the requeue."""

    def __init__(self, step: int, path: Path) -> None:
        super().__init__(f"checkpointed at step {step} into {path} for Slurm's requeue")
        self.step, self.path = step, path


class Preemption:
    """The rank's view of Slurm's warning: `install()` the handler, `agreed()` at each boundary."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> Preemption:
        signal.signal(signal.SIGUSR1, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested = True  # only a flag: the step in progress finishes first

    def agreed(self) -> bool:
        """True on every rank once any rank got the signal (a collective: every rank calls it each step)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.requested
        from engine.device import init_host_group

        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=init_host_group())
        return bool(flag[0])


def enabled() -> bool:
    """Whether this rank runs in a job that asked for the warning signal."""
    return os.environ.get(ENV) == "1"


def checkpoint_and_leave(state, step: int, folder: Path, run_dir: Path, rank: int) -> None:
    """Write the checkpoint of the `step` steps done (`state`: engine.train.checkpoint.RankState), leave the
    requeue marker (rank 0), raise Preempted."""
    from engine.train import checkpoint as ckpt

    path = ckpt.save(state, step, folder)
    if rank == 0:
        (run_dir / MARKER).write_text(f"{step}\n")
    raise Preempted(step, path)


def resume_point(folder: Path) -> Path | None:
    """The newest complete checkpoint in `folder` (the highest step; DCP writes `.metadata` last), or None."""
    from engine.train.checkpoint import latest_checkpoint

    return latest_checkpoint(folder)


def requeue_lines(run_dir: Path) -> list[str]:
    """The batch script's tail after srun: requeue the job if the ranks checkpointed for it."""
    marker = shlex.quote(str(run_dir / MARKER))
    return ["status=$?",
            f"if [ -e {marker} ]; then rm -f {marker}; scontrol requeue \"$SLURM_JOB_ID\"; exit 0; fi",
            "exit $status"]


def main(argv: list[str]) -> None:
    """Exec `argv` with SIGUSR1 ignored (the disposition survives exec)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
