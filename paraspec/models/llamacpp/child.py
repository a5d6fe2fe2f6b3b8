"""What a process killed by a signal means, in words a user can act on (workers, the exactness probe, the build's
smoke run); `run_child`, which runs llama.cpp work that may crash in a child process.

Native kernels (llama.cpp, oneDNN) can kill the process that runs them: an instruction the CPU or the VM refuses
(SIGILL: an AMX, AVX-512 or VNNI instruction of a build made for another CPU, or one the hypervisor does not
expose), a bad memory access (SIGSEGV, SIGBUS). Such a death must reach the caller as an error that says what
happened and what rebuilds the library, never as a bare exit code.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

# what each signal means for a process running paraspec's kernels
MEANINGS = {
    "SIGILL": "an instruction this CPU or VM refuses (a kernel compiled for instructions it lacks, or a CPU "
    "feature used in a state the CPU does not allow, such as AMX tiles that were not configured)",
    "SIGSEGV": "a bad memory access in native code",
    "SIGBUS": "a bad memory access in native code (a memory-mapped model file truncated on disk, or a misaligned "
    "access)",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGABRT": "native code aborted (an assertion in llama.cpp/ggml or torch; the process's stderr has the line)",
    "SIGKILL": "killed from outside: most often the kernel's out-of-memory killer (`dmesg` says so), or a user",
}
# the signals that point at the compiled kernels, not at the rest of the machine
NATIVE = ("SIGILL", "SIGSEGV", "SIGBUS", "SIGFPE")


class NativeCrash(RuntimeError):
    """A child process running native kernels was killed by a signal."""

    def __init__(self, message: str, exitcode: int | None):
        super().__init__(message)
        self.exitcode = exitcode


def signal_name(exitcode: int | None) -> str | None:
    """'SIGILL' for a process killed by SIGILL (multiprocessing's -4, or a shell's 132), else None."""
    if exitcode is None:
        return None
    number = -exitcode if exitcode < 0 else exitcode - 128 if 128 < exitcode < 160 else 0
    if number <= 0:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def llamacpp_build() -> str | None:
    """The llama.cpp build installed in this environment (scripts/build_llamacpp.py records it), if known."""
    marker = Path(sys.prefix) / ".paraspec-llamacpp-build"
    try:
        return marker.read_text().strip() or None
    except OSError:
        return None


def rebuild_command() -> str:
    return f"python scripts/build_llamacpp.py wheel --force --python {sys.executable}"


def describe_death(exitcode: int | None) -> str:
    """' with signal SIGILL (<meaning>); <which llama.cpp build, how to rebuild it>' for a signal, ' with exit code
    N' for an exit, '' when unknown."""
    name = signal_name(exitcode)
    if name is None:
        return "" if exitcode is None else f" with exit code {exitcode}"
    text = f" with signal {name}"
    if name in MEANINGS:
        text += f" ({MEANINGS[name]})"
    if name in NATIVE:
        build = llamacpp_build()
        text += (
            f"; if it ran llama.cpp's kernels, the build{f' {build}' if build else ''} does not suit this "
            f"CPU: rebuild it with `{rebuild_command()}` (the build is checked in a child process and made "
            f"again without the instructions that crash), or use backend='native'"
        )
    return text


# the child that runs llama.cpp work which may crash (tests replace it with a child that crashes on purpose)
CHILD_COMMAND = [sys.executable, "-m", "paraspec.models.llamacpp.child_tasks"]


def run_child(args: list[str], what: str, timeout: float | None = None) -> dict:
    """Run `CHILD_COMMAND + args` (models/llamacpp/child_tasks.py) and return its JSON answer; a child killed by a
    signal raises NativeCrash naming the signal and what it means, any other failure a RuntimeError with the
    child's last lines of stderr."""
    try:
        proc = subprocess.run([*CHILD_COMMAND, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish in {timeout:g} s") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        death = describe_death(proc.returncode)
        if proc.returncode < 0:
            raise NativeCrash(
                f"{what} died{death}" + (f"\n--- its stderr ---\n{tail}" if tail else ""), proc.returncode
            )
        raise RuntimeError(f"{what} failed{death}:\n{tail}")
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"{what} gave no answer (stdout: {proc.stdout[-500:]!r})") from None
