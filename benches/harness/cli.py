"""The command line the benches share: the parser, the timer's and the outputs' flags,
comma lists, ``--budget-s``, the no-GPU exit and the process group of the multi-GPU
benches."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

import torch


def line_buffered_stdout() -> None:
    """Print every line as it comes (a log cut off by a time limit keeps the progress)."""
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass


def parser(doc: str) -> argparse.ArgumentParser:
    """A bench's argument parser, its module docstring as the description."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_output_args(p, budget: str = "row", png: bool = False, merge: bool = True) -> None:
    """``--budget-s``, ``--json``, ``--md``, ``--png`` (with ``png``), ``--dry-run`` and
    ``--from-json`` (a comma list merged into one table with ``merge``)."""
    p.add_argument(
        "--budget-s", type=float, default=0, help=f"start no new {budget} after this many seconds"
    )
    add_doc_args(p, merge=merge)
    if png:
        p.add_argument("--png", help="a chart of the run (needs matplotlib)")
    p.add_argument("--dry-run", action="store_true", help="print the rows; no GPU")


def add_doc_args(p, every: str = "row", merge: bool = True) -> None:
    """``--json`` and ``--md`` (rank 0's, rewritten after every ``every``) and ``--from-json``
    (a comma list merged into one table with ``merge``)."""
    p.add_argument("--json", help=f"results, rewritten after every {every}")
    p.add_argument("--md", help=f"the table in markdown, rewritten after every {every}")
    what = "result files (comma list: merged into one table)" if merge else "a result file"
    p.add_argument("--from-json", help=f"render {what}; no GPU")


def add_rr_args(p, rounds, sample_ms, min_calls, max_calls, warmup=2, unit="calls", notes=None):
    """The timer's flags (``harness.timing.RR_ARGS``) with these defaults; ``notes``: flag
    -> words added to its help."""
    notes = notes or {}

    def h(key, text=""):
        return " ".join(t for t in (text, notes.get(key)) if t) or None

    p.add_argument("--rounds", type=int, default=rounds, help=h("rounds", "round-robin rounds"))
    p.add_argument("--sample-ms", type=float, default=sample_ms, help=h("sample_ms", "GPU ms"))
    p.add_argument("--calls", type=int, help=f"fixed back-to-back {unit} per sample")
    p.add_argument("--min-calls", type=int, default=min_calls)
    p.add_argument("--max-calls", type=int, default=max_calls, help=h("max_calls"))
    p.add_argument("--warmup", type=int, default=warmup, help=f"{unit} before timing, per row")


def check_rr_args(p, args) -> None:
    if min(args.rounds, args.min_calls, args.max_calls, args.warmup) < 1:
        p.error("rounds, calls and warmup must be at least 1")


def check_lists(p, *pairs) -> None:
    """Each ``(comma list, allowed values)``: every value allowed, else ``p.error``."""
    for lst, ok in pairs:
        bad = [v for v in lst.split(",") if v not in ok]
        if bad:
            p.error(f"unknown {bad}; choose from {', '.join(ok)}")


def no_cuda() -> bool:
    """True, said on stdout, where there is no CUDA device to measure on."""
    if torch.cuda.is_available():
        return False
    print("no CUDA device: nothing to measure (--dry-run or --from-json work on the CPU)")
    return True


def budget_spent(args, t_start: float, spec: str = "g"):
    """Why no new row starts (``--budget-s`` spent since ``t_start``), or None."""
    if args.budget_s and time.perf_counter() - t_start > args.budget_s:
        return f"--budget-s {args.budget_s:{spec}} spent"
    return None


def comma_list(arg: str) -> list:
    return [t.strip() for t in arg.split(",") if t.strip()]


def init_ranks(device, timeout_s: float) -> torch.device:
    """``torch.distributed`` for a run under ``torchrun``: NCCL on this process's GPU, or
    gloo on the CPU; a plain ``python3`` run is a world of one. Returns the device."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        return dev
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def leave(code: int) -> None:
    """End every rank of a multi-GPU bench together, without destroying the process group
    (gloo's teardown after collectives sometimes aborts)."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a rank that failed already
        pass
    os._exit(code)
