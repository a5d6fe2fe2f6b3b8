"""A native crash in a child (the exactness probe, the build's smoke run) is an error in the caller that names the
signal and what it means; the caller lives on. The crash is injected (a child that kills itself with SIGILL): no
CPU that really refuses an instruction is needed."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from paraspec.models.llamacpp import child as crashes
from paraspec.models.llamacpp import model as llamacpp
from paraspec.models.llamacpp.child import NativeCrash, describe_death, signal_name


def test_signal_names_from_exit_codes():
    assert signal_name(-signal.SIGILL) == "SIGILL"  # multiprocessing / subprocess
    assert signal_name(128 + signal.SIGSEGV) == "SIGSEGV"  # a shell's way
    assert signal_name(0) is None and signal_name(1) is None and signal_name(None) is None
    assert describe_death(3) == " with exit code 3" and describe_death(None) == ""
    kill = describe_death(-signal.SIGKILL)
    assert "out-of-memory" in kill and "build_llamacpp" not in kill  # not the kernels' fault: no rebuild advice


def test_sigill_names_the_build_and_the_command_that_rebuilds_it(monkeypatch, tmp_path):
    monkeypatch.setattr(crashes.sys, "prefix", str(tmp_path))
    (tmp_path / ".paraspec-llamacpp-build").write_text("/cache/wheel-0.3.36-abc/llama_cpp_python.whl")
    text = describe_death(-signal.SIGILL)
    assert text.startswith(" with signal SIGILL (an instruction this CPU or VM refuses")
    assert "/cache/wheel-0.3.36-abc/llama_cpp_python.whl" in text
    assert f"python scripts/build_llamacpp.py wheel --force --python {sys.executable}" in text


def crash_with(monkeypatch, sig: signal.Signals) -> None:
    """Every llama.cpp child from now on dies with `sig` before it answers."""
    monkeypatch.setattr(
        crashes, "CHILD_COMMAND", [sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), signal.{sig.name})"]
    )


def test_a_child_killed_by_a_signal_is_a_native_crash_here(monkeypatch):
    crash_with(monkeypatch, signal.SIGILL)
    with pytest.raises(NativeCrash, match="the probe died with signal SIGILL") as info:
        crashes.run_child(["probe", "{}"], "the probe")
    assert info.value.exitcode == -signal.SIGILL


def test_a_child_that_fails_without_a_signal_shows_its_stderr(monkeypatch):
    monkeypatch.setattr(crashes, "CHILD_COMMAND", [sys.executable, "-c", "raise SystemExit('no model here')"])
    with pytest.raises(RuntimeError, match="no model here") as info:
        crashes.run_child([], "the probe")
    assert not isinstance(info.value, NativeCrash)


def test_the_first_probe_crashing_leaves_the_caller_alive_and_caches_nothing(gguf_pair, monkeypatch, tmp_path):
    """The first probe of a (build, CPU, model) runs in a child: a kernel that kills it (SIGILL, injected) is a
    NativeCrash here, no verdict is cached, and the same model loads once the child survives."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    crash_with(monkeypatch, signal.SIGILL)
    with pytest.raises(NativeCrash, match="exactness probe of .* died with signal SIGILL"):
        llamacpp.LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)
    assert not list((tmp_path / "llamacpp" / "exactness").glob("*.json"))
    monkeypatch.undo()
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    model = llamacpp.LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)
    assert model.exact_width >= 1
    records = list((tmp_path / "llamacpp" / "exactness").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["exact_width"] == model.exact_width
    model.close()


def test_the_probe_in_the_child_measures_what_the_caller_would(gguf_pair, monkeypatch, tmp_path):
    """The child's verdict is the in-process measurement's (same file, kernels, threads, build)."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    model = llamacpp.LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1, probe=False, kernels="plain")
    width, rows = llamacpp.run_probe(model)
    assert (width, rows) == llamacpp.measure_exact_width(model)
    model.close()
