"""The local launcher's torchrun for CPU ranks: torch's own elastic agent (`torch.distributed.run`, its
arguments unchanged) with each rank forked from it instead of started as a fresh interpreter.

`python -m engine.launch.agent TORCHRUN-ARGS -m engine.launch.worker ARGS` imports torch, torch._dynamo
(every optimizer's step imports it) and the worker's modules once, then runs torchrun with its own
`--run-path` (the worker's file, run by runpy in each rank) and `--start-method fork`, so a rank starts from
those imports (and what its config needs: `import_what_the_run_needs`) instead of repeating them (about 2 s of CPU
each on a 2-core host, 1.8 s more for a transformers model: bench/launch_fork.py).
Single-node gloo runs only (engine/launch/local.py `forks_ranks`): NCCL ranks and other nodes start as
torchrun starts them, and `workbench export --format torchrun` prints that line (engine/launch/torchrun.py).

The agent itself is forked too, from a server its launcher keeps (engine/launch/agent_server.py).
"""
from __future__ import annotations

import signal
import sys

WORKER = "engine.launch.worker"


def fork_arguments(argv: list[str]) -> list[str]:
    """torchrun's arguments with `-m engine.launch.worker` replaced by the worker's file under `--run-path`,
    the ranks forked."""
    import engine.launch.worker as worker

    at = argv.index("-m") if "-m" in argv else -1
    if at < 0 or argv[at + 1] != WORKER:
        raise ValueError(f"engine.launch.agent runs `-m {WORKER}` only: {' '.join(argv)}")
    return ["--start-method=fork", "--run-path"] + argv[:at] + [worker.__file__] + argv[at + 2:]


def report_each_failed_rank() -> None:
    """Make the agent print every rank that had already ended badly when it noticed a failure, as torchrun's
    report does for ranks it starts as interpreters (the form engine/launch/run_record.py `first_failure`
    reads). With forked ranks torch's agent names only the first failed rank its poll finds, in rank order,
    so rank 0 exiting on a peer's lost connection hid the rank SIGKILLed before it (the OOM killer's case).
    Wraps the public `torch.multiprocessing.ProcessContext.join` the agent polls the ranks with: the exit
    codes are read (non-blocking, through multiprocessing) before its clean-up stops the others."""
    from torch.multiprocessing import ProcessContext

    join = ProcessContext.join

    def join_reporting(self, *args, **kwargs):
        ended = [process.exitcode for process in self.processes]
        try:
            return join(self, *args, **kwargs)
        except Exception:
            for rank, code in enumerate(ended):
                if code:
                    how = f" ({signal.Signals(-code).name})" if code < 0 else ""
                    print(f"[engine.launch.agent] rank ended before the others were stopped:\n"
                          f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code}{how}", flush=True)
            raise

    ProcessContext.join = join_reporting


def import_what_the_run_needs(argv: list[str]) -> None:
    """Import what each rank would import for itself after the fork for this run's config: torch's pipelining
    (pp > 1) and, for a transformers model (`model.hf`), transformers and the model's class (about 1.8 s of CPU
    per rank on a 2-core host). A config this cannot read is left to the ranks, which report its error with
    their rank."""
    from engine.launch.worker import _load

    try:
        config = _load(argv[argv.index("--config") + 1])
        if (config.get("parallel") or {}).get("pp", 1) > 1:
            import engine.parallel.pipeline  # noqa: F401
        hf = (config.get("model") or {}).get("hf")
        if hf:
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

            from engine.model.hf import hf_config

            MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config(hf))]  # transformers imports the class's module lazily
    except Exception:  # noqa: BLE001 - never the agent's failure: the ranks meet it and name their rank
        return


def main(argv: list[str] | None = None) -> None:
    import torch._dynamo  # noqa: F401 - once here, not once in each rank
    from torch.distributed.run import main as torchrun

    argv = sys.argv[1:] if argv is None else argv
    report_each_failed_rank()
    import_what_the_run_needs(argv)
    torchrun(fork_arguments(argv))


if __name__ == "__main__":
    main()
