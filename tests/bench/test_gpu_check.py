"""`make gpu-check` on the CPU with tiny shapes, so the command a borrowed GPU runs cannot rot between sessions:
every section's content, ar's tokens from every strategy, nothing imported that the GPU machine lacks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from paraspec.models.native.padded import WIDTHS

ROOT = Path(__file__).resolve().parents[2]
ABSENT_ON_GPU_MACHINE = ("ray", "fastapi", "uvicorn", "openai", "llama_cpp")
MEASURED = (
    "environment",
    "forward_cost",
    "strategies",
    "planner",
    "profile",
    "compiled",
)  # the suite runs in CI anyway


def without_modules(tmp_path: Path) -> dict:
    """An environment whose Python (and every process it spawns) fails to import the GPU machine's missing
    packages: a sitecustomize.py that puts None in sys.modules for each."""
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT_ON_GPU_MACHINE!r}:\n    sys.modules[name] = None\n"
    )
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out, site = tmp_path_factory.mktemp("gpu-check"), tmp_path_factory.mktemp("site")
    env = without_modules(site)
    blocked = subprocess.run([sys.executable, "-c", "import fastapi"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "halted" in blocked.stderr  # the blocking itself works
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--sections",
            ",".join(MEASURED),
            "--budget-s",
            "300",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "gpu_check.json").read_text()), proc.stdout


def test_every_section_ran_without_the_missing_packages(cpu_run):
    out, report, stdout = cpu_run
    sections = report["sections"]
    assert {name: sections[name]["status"] for name in MEASURED} == dict.fromkeys(MEASURED, "ok"), {
        name: sections[name].get("error") for name in MEASURED
    }
    assert "suite" not in sections and report["settings"]["quick"] is True
    assert "strategies: dsi a=0.8: TPOT" in stdout  # progress is printed as it goes
    files = list(out.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in files)


def test_environment_names_the_versions(cpu_run):
    env = cpu_run[1]["sections"]["environment"]
    import torch

    assert env["torch"] == torch.__version__ and env["device"].startswith("cpu")
    assert env["git_commit"] == "unknown" or len(env["git_commit"]) == 40


def test_forward_costs_are_measured_at_every_width(cpu_run):
    models = cpu_run[1]["sections"]["forward_cost"]["models"]
    assert set(models) == set(gpu_check.QUICK_SHAPES)
    for shape, m in models.items():
        for key in ("dynamic_ms", "padded_eager_ms"):
            assert sorted(map(int, m[key])) == list(WIDTHS)
            assert all(ms > 0 for ms in m[key].values()), (shape, key, m[key])
        assert "padded_graph_ms" not in m  # no CUDA graph on a CPU
        assert m["chosen_width"] in WIDTHS


def test_every_strategy_returns_ar_tokens(cpu_run):
    record = cpu_run[1]["sections"]["strategies"]
    runs = record["runs"]
    assert [(r["strategy"], r["acceptance_rate"]) for r in runs] == [
        ("ar", None),
        ("sd", 0.6),
        ("sd", 0.8),
        ("sd", 0.95),
        ("amusd", 0.8),
        ("dsi", 0.8),
    ]
    for r in runs:
        assert "error" not in r, r["error"]
        assert r["tokens_match_ar"] is True and r["tokens_match_truth"] is True, r
        assert r["tpot_ms"] > 0 and r["new_tokens"] == record["new_tokens"]
        assert (r["measured_acceptance"] is None) == (r["strategy"] == "ar")


def test_the_planner_answers_for_each_device_count(cpu_run):
    plans = cpu_run[1]["sections"]["planner"]["plans"]
    assert [(p["acceptance_rate"], p["devices"]) for p in plans] == [
        (a, n) for a in gpu_check.ACCEPTANCE for n in gpu_check.PLANNER_DEVICES
    ]
    for p in plans:
        assert p["recommended"] in ("ar", "sd", "amusd", "dsi") and p["tpot_ms"] > 0
        assert (p["best_tpot_ms"]["dsi"] is None) == (p["devices"] == 1)  # dsi needs a second device


def test_the_compiled_step_is_timed_and_returns_the_same_tokens(cpu_run):
    record = cpu_run[1]["sections"]["compiled"]
    assert [(r["strategy"], r["compiled"]) for r in record["runs"]] == [
        ("ar", False),
        ("ar", True),
        ("sd", False),
        ("sd", True),
    ]
    for r in record["runs"]:
        assert "error" not in r, r["error"]
        assert r["tokens_match_ar"] is True and r["tpot_ms"] > 0 and r["padded_width"] == 8
    for shape in gpu_check.QUICK_PAIRS[0]:
        m = record["models"][shape]
        assert set(m["compiled_graph_ms"]) == set(m["graph_ms"]) == {"8"} and m["compiled_graph_ms"]["8"] > 0


def test_the_profile_says_where_a_step_goes(cpu_run):
    record = cpu_run[1]["sections"]["profile"]
    assert record["width"] == gpu_check.PROFILE_WIDTH
    assert set(record["models"]) == set(gpu_check.QUICK_PAIRS[0])
    for m in record["models"].values():
        assert "error" not in m, m["error"]
        assert set(m) == {"eager"}  # no graph replay on a CPU
        eager = m["eager"]
        assert eager["wall_ms"] > 0 and eager["kernels_per_step"] == 0  # no device kernels on a CPU
        assert eager["top_kernels"] == []
        costs = [o["ms"] for o in eager["top_ops"]]
        assert costs and costs == sorted(costs, reverse=True)  # the costliest first
        assert "matmul" in eager["op_kinds"] and eager["op_ms"] > 0
        # times per step, not summed over the PROFILE_STEPS steps (that sum would be ~PROFILE_STEPS x a step):
        # the ops' self times fit inside the wall time of the profiled steps they ran in (measured in the same
        # window, so a busy machine slows both; `wall_ms`, timed apart without the profiler, is no yardstick)
        assert 0 < eager["op_ms"] <= 1.05 * eager["profiled_ms"], (eager["op_ms"], eager["profiled_ms"])


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "matmul"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            "elementwise",
        ),
        ("void at::native::index_elementwise_kernel<128, 4>", "copy/index"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_coopA_TNN", "matmul"),  # cuBLAS's H100 kernels
        ("triton_poi_fused_add_mul_0", "other"),
    ],
)
def test_kernel_kinds(name, kind):
    assert gpu_check.kind_of(name, gpu_check.KERNEL_KINDS) == kind


@pytest.mark.parametrize(
    "op, kind",
    [
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten::bmm", "matmul"),
        ("aten::_scaled_dot_product_flash_attention", "attention"),
        ("aten::index_copy_", "copy/index"),
        ("aten::copy_", "copy/index"),
        ("aten::masked_fill_", "copy/index"),
        ("aten::mul", "elementwise/norm"),
        ("aten::rsqrt", "elementwise/norm"),
        ("aten::mean", "elementwise/norm"),
    ],
)
def test_op_kinds(op, kind):
    assert gpu_check.op_kind(op) == kind


def test_the_summary_has_every_table(cpu_run):
    md = (cpu_run[0] / "gpu_check.md").read_text()
    for heading in (
        "## Environment",
        "## Forward cost by width",
        "## Strategies through the Engine",
        "## Planner predictions",
        "predicted vs measured",
        "## Where a step's time goes",
        "## The step through torch.compile",
    ):
        assert heading in md


@pytest.mark.parametrize(
    "value, device, has_xdist, expected",
    [
        ("0", "cpu", False, 0),
        ("3", "cuda:0", True, 3),
        ("auto", "cpu", True, 0),
        ("auto", "cuda:0", False, 0),
        ("auto", "cuda:0", True, min(8, (os.cpu_count() or 2) // 2)),
        ("3", "cuda:0", False, "pytest-xdist"),
        ("-1", "cpu", True, "an integer"),
        ("many", "cpu", True, "an integer"),
    ],
)
def test_suite_workers(value, device, has_xdist, expected, monkeypatch):
    import argparse
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if has_xdist else None) if name == "xdist" else real_find_spec(name, *a),
    )
    parser = argparse.ArgumentParser()
    if isinstance(expected, int):
        assert gpu_check.suite_workers(parser, value, device) == expected
    else:
        monkeypatch.setattr(parser, "error", lambda message: (_ for _ in ()).throw(ValueError(message)))
        with pytest.raises(ValueError, match=expected):
            gpu_check.suite_workers(parser, value, device)


def test_a_failing_section_leaves_the_others_running(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("no device here")

    monkeypatch.setattr(gpu_check, "environment", broken)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--sections", "environment,planner"]) == 0
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["environment"]["status"] == "failed"
    assert "RuntimeError: no device here" in sections["environment"]["error"]
    assert sections["planner"]["status"] == "ok"  # ran, and says what it lacked
    assert "no forward_cost measurement" in sections["planner"]["plans"][0]["error"]
    assert "no device here" in (tmp_path / "gpu_check.md").read_text()


def test_no_section_starts_past_the_budget(tmp_path):
    gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "0"])
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert {s["status"] for s in sections.values()} == {"skipped"} and set(sections) == set(gpu_check.SECTIONS)


def test_the_suite_runs_on_the_device_and_is_cut_at_its_cap(tmp_path, monkeypatch):
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import os, time, pytest\n"
        "def test_device():\n    assert os.environ['PARASPEC_TEST_DEVICE'] == 'cpu'\n"
        "@pytest.mark.skip\ndef test_skipped():\n    pass\n"
        "def test_slow():\n    time.sleep(float(os.environ.get('SLOW_S', '0')))\n"
    )
    monkeypatch.setattr(gpu_check, "SUITE_FILES", (str(tests), "tests/not_there.py"))
    check = gpu_check.Check("cpu", tmp_path, quick=True, budget_s=60, sections=("suite",))
    record = {}
    gpu_check.suite(check, record, gpu_check.time.perf_counter() + 60, lambda: None)
    assert record["outcome"] == "passed", record["tail"]
    assert record["counts"]["passed"] == 2 and record["counts"]["skipped"] == 1
    assert record["missing"] == ["tests/not_there.py"]

    monkeypatch.setenv("SLOW_S", "60")
    record = {}
    gpu_check.suite(check, record, gpu_check.time.perf_counter() + 4, lambda: None)
    assert record["outcome"].startswith("timeout") and record["counts"] is None


def test_failed_tests_are_read_from_the_verbose_lines():
    output = (
        "[gw3] [ 12%] FAILED tests/a.py::test_x[1-2] \ntests/b.py::test_y PASSED\n"
        "tests/c.py::test_z FAILED                     [ 50%]\nFAILED tests/a.py::test_x[1-2] - AssertionError\n"
        "ERROR tests/d.py::test_w - boom\n[gw1] [ 13%] PASSED tests/e.py::test_v\n"
    )
    assert gpu_check.failed_tests(output) == ["tests/a.py::test_x[1-2]", "tests/c.py::test_z", "tests/d.py::test_w"]


@pytest.mark.parametrize(
    "output, counts",
    [
        (
            "....F\n!!! stopping after 1 failures !!!\n3 failed, 40 passed, 2 skipped, 1 warning in 12.34s\n",
            dict(passed=40, failed=3, skipped=2, error=0, warning=1, seconds=12.34),
        ),
        ("===== 5 passed in 75.12s (0:01:15) =====", dict(passed=5, failed=0, skipped=0, error=0, seconds=75.12)),
        ("1 passed, 2 errors in 0.10s\n\n", dict(passed=1, failed=0, skipped=0, error=2, seconds=0.1)),
        ("no tests ran in 0.01s", dict(passed=0, failed=0, skipped=0, error=0, seconds=0.01)),
        ("collecting ... 3 passed so far\ntests/x.py ..", None),  # killed before its summary
    ],
)
def test_pytest_summary_parser(output, counts):
    assert gpu_check.parse_pytest_summary(output) == counts


def test_make_gpu_check_on_a_cpu_runs_the_venvs_python(tmp_path):
    """`make gpu-check DEVICE=cpu` on a machine `make setup` set up runs the venv's Python (the system python3 may
    lack torch); on a GPU (or with no venv) python3, whose torch is the GPU machine's."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make here")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)

    def command(device: str) -> str:
        proc = subprocess.run(
            ["make", "-n", "--no-print-directory", "-C", str(tmp_path), "gpu-check", f"DEVICE={device}"],
            capture_output=True,
            text=True,
            check=True,
        )
        return proc.stdout.strip().splitlines()[-1]

    assert command("cpu").startswith("PYTHONPATH=. python3 -m benchmarks.gpu_check --device cpu")  # no venv
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    assert command("cpu").startswith("PYTHONPATH=. .venv/bin/python -m benchmarks.gpu_check --device cpu")
    assert command("cuda:0").startswith("PYTHONPATH=. python3 -m benchmarks.gpu_check --device cuda:0")
