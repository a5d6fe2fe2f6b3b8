import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chisquare

from tests.tiny import make_checkpoint

# shared by the strategy, engine, runtime and multi-node tests
PROMPT = "def fib(n):\n    return"

# where the lossless suite, the verify/sampling tests and the native-model tests put their models and tensors:
# `PARASPEC_TEST_DEVICE=cuda:0 pytest ...` runs them on a GPU (make gpu-check does); CPU by default
TEST_DEVICE = os.environ.get("PARASPEC_TEST_DEVICE", "cpu")
ON_CUDA = TEST_DEVICE.startswith("cuda")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs PARASPEC_TEST_DEVICE=cuda:N (a CUDA device)")
on_cpu_only = pytest.mark.skipif(ON_CUDA, reason="CPU core sets and pinning: not what a CUDA run checks")


def on_device(**placement) -> dict:
    """Engine keyword arguments that put every model on TEST_DEVICE (nothing on CPU: the defaults), or, given
    CPU placements (e.g. target_devices=["cpu:0", "cpu:1"]), the same number of devices on TEST_DEVICE."""
    if not ON_CUDA:
        return placement
    out = dict(target_devices=[TEST_DEVICE], draft_devices=[TEST_DEVICE])
    out.update({key: [TEST_DEVICE] * len(value) for key, value in placement.items()})
    return out


def devices(n: int = 1) -> list[str]:
    """n devices for a strategy's workers: CPU core sets cpu:0, cpu:1 (one core each) here, the one test GPU
    n times under PARASPEC_TEST_DEVICE=cuda:N (workers then share it)."""
    return [TEST_DEVICE] * n if ON_CUDA else [f"cpu:{i}" for i in range(n)]


def pytest_configure(config):
    """Ctrl-C as a terminal delivers it, also when the suite was started in the background of a shell without job
    control (`make test &`, `nohup ... &`): such a shell starts it with SIGINT ignored, which Python and every
    child process inherit, and the Ctrl-C tests (test_misuse.py) would see their signals ignored."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # children exec'd from here get SIG_DFL


# tests that join the session's Ray cluster (ray_cluster, some through request.getfixturevalue); under pytest-xdist
# each worker that runs one starts its own cluster
RAY_FILES = ("test_multinode.py", "runtime/test_ray.py", "runtime/test_channel_processes.py")


# `slow` (left out by `make test-fast`, the inner loop's representative subset): the chi-square checks of sampling
# (a thousand requests or more each), Ray nodes, the HTTP server in its own process, fault injection across
# processes, and single tests of several seconds each on a 2-core machine. The greedy lossless suite, the unit tests and
# the tiny GGUF tests stay in the fast subset.
SLOW_FILES = RAY_FILES + (
    "test_misuse.py",
    "runtime/test_faults.py",
    "models/test_llamacpp_batch.py",
    "bench/test_gpu_check.py",  # its module fixture runs the whole GPU check on tiny shapes
)
SLOW_WORDS = (
    "distribution",
    "joint",
    "follows_the_target",
    "follow_the_target",
    "catches_a_wrong_rule",
    "has_power",
    "marginals",
    "reproduces_p",
)
SLOW_TESTS = {
    "test_worker_processes",
    "test_wall_time_is_close_to_the_event_simulator",
    "test_rows_equal_one_row_products",  # the kernel programs; whole repacked models stay fast
    "test_the_engine_widens_llama_cpp_drafts_only",
    "test_probe_measures_and_is_cached",
    "test_auto_keeps_the_repacked_kernels_where_they_are_exact",
    "test_every_section_ran_without_the_missing_packages",
    "test_streaming_4000_tokens_decodes_each_token_a_few_times",
    "test_bench_runs_every_registered_strategy",
    "test_server_dying_while_others_hold_chunks",
    "test_concurrent_requests_are_each_bit_identical_to_alone",
    "test_stop_string_cuts_like_ar",
    "test_a_compiled_step_keeps_rows_independent_of_the_split",
    "test_draft_ranks_are_the_engines_workers",
    "test_amusd_uses_both_paths_and_overlaps",
    "test_close_leaves_nothing_behind",
    "test_killed_draft_worker_is_reported_within_seconds",
    "test_abandoned_stream_cancels_cleanly",
    "test_probe_cache_tells_kernels_apart",  # tiny GGUFs probed under several kernel settings; one stays fast
    "test_a_tiled_matmul_asked_for_where_it_is_not_exact_is_refused",
    "test_compiled_step_greedy_equals_ar",  # torch.compile on a CPU; the padded width's greedy tests stay fast
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.as_posix()
        name = getattr(item, "originalname", None) or item.name
        slow = "/tests/server/" in path or path.endswith(SLOW_FILES) or name in SLOW_TESTS
        if slow or any(word in name for word in SLOW_WORDS):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` (--dist loadfile: a file on one worker): the longest
        # files first, the reference pair's then Ray's, so that no worker ends the run with one of them alone
        items.sort(key=lambda item: 0 if item.get_closest_marker("real_pair") else 1 if is_ray(item) else 2)


def is_ray(item) -> bool:
    return "ray_cluster" in getattr(item, "fixturenames", ()) or item.path.as_posix().endswith(RAY_FILES)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def qwen2_target(tiny_dir):
    return make_checkpoint(tiny_dir / "qwen2-target", "qwen2", seed=1, scale=20)


@pytest.fixture(scope="session")
def qwen2_unrelated(tiny_dir):
    return make_checkpoint(tiny_dir / "qwen2-unrelated", "qwen2", seed=2, scale=20)


@pytest.fixture(scope="session")
def qwen2_partial(tiny_dir, qwen2_target):
    """The target with noise on every weight: agrees on some tokens, not all."""
    return make_checkpoint(tiny_dir / "qwen2-partial", "qwen2", seed=3, base=qwen2_target, noise=0.05)


@pytest.fixture(scope="session")
def llama_target(tiny_dir):
    return make_checkpoint(tiny_dir / "llama-target", "llama", seed=4, scale=20)


@pytest.fixture(scope="session")
def mistral_target(tiny_dir):
    return make_checkpoint(tiny_dir / "mistral-target", "mistral", seed=5, scale=20)


@pytest.fixture(scope="session")
def deep_pair(tiny_dir):
    """A 6-layer target and a noisy copy as draft: deep enough for EasySpec groups of 2 and 3 layers."""
    target = make_checkpoint(tiny_dir / "deep-t", "qwen2", seed=1, scale=20, num_hidden_layers=6)
    draft = make_checkpoint(tiny_dir / "deep-d", "qwen2", seed=3, base=target, noise=0.05)
    return target, draft


@pytest.fixture(scope="session")
def gguf_pair(tiny_dir):
    """Tiny Qwen2 GGUF files (2048-token context) for the llamacpp backend: an f32 target with peaked logits, a
    draft that partly agrees with it (the target plus noise), the target as an HF checkpoint folder (the same
    weights, for the native decoder), and a milder model with Q8_0 matrices (at the target's weight scale the
    random model is chaotic enough to amplify llama.cpp's 8-bit activations far beyond their rounding), and a
    pair for sampling tests whose draft's first tokens overlap the target's (13-25% acceptance)."""
    from tests.tiny_gguf import noisy_copy, tiny_hf_model, tiny_vocab, write_gguf

    vocab = len(tiny_vocab()[0])
    target = tiny_hf_model("qwen2", vocab, tied=True, seed=11, scale=20, max_position_embeddings=2048)
    out = {
        "target": tiny_dir / "gguf-target.gguf",
        "draft": tiny_dir / "gguf-draft.gguf",
        "target_q8": tiny_dir / "gguf-target-q8.gguf",
        "target_hf": tiny_dir / "gguf-target-hf",
        "sample_target": tiny_dir / "gguf-sample-t.gguf",
        "sample_draft": tiny_dir / "gguf-sample-d.gguf",
    }
    write_gguf(out["target"], target)
    write_gguf(out["draft"], noisy_copy(target, seed=12, noise=0.3))
    mild = tiny_hf_model("qwen2", vocab, tied=True, seed=13, scale=5, max_position_embeddings=2048)
    q8 = {name: "Q8_0" for name, t in mild.state_dict().items() if t.ndim == 2 and "embed" not in name}
    write_gguf(out["target_q8"], mild, quantize=q8)
    sampled = tiny_hf_model("qwen2", vocab, tied=True, seed=13, scale=10, max_position_embeddings=2048)
    write_gguf(out["sample_target"], sampled)
    write_gguf(out["sample_draft"], noisy_copy(sampled, seed=12, noise=0.3))
    target.save_pretrained(str(out["target_hf"]))
    return out


def cores_of_this_worker() -> int:
    """The cores this test process may keep busy: all it may use, shared among pytest-xdist's workers when the
    suite runs in several (more intra-op threads than cores stall torch's and llama.cpp's thread barriers)."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids oversubscription stalls."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head and two worker nodes, each with a
    custom resource that names it (head-box, box-a, box-b), joined by this process. paraspec places workers on
    them by name as on separate machines; tests force the network transport, since the nodes share a host."""
    ray = pytest.importorskip("ray", reason="multi-node tests need Ray (pip install 'paraspec[ray]')")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head-box": 1}})
    try:
        for name in ("box-a", "box-b"):
            cluster.add_node(num_cpus=1, resources={name: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def busy_s(trace, kind: str) -> float:
    """Seconds a trace's events of `kind` (draft, verify, ...) took, summed over devices."""
    return sum(e.duration_s for e in trace.events if e.kind == kind)


# -- the sampling checks: a small vocabulary, the target's exact joint of the first two tokens ---------------

VOCAB = 6


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("small-vocab")
    target = make_checkpoint(d / "t", "qwen2", seed=21, scale=5, tokenizer=False, vocab_size=VOCAB, eos_token_id=None)
    draft = make_checkpoint(d / "d", "qwen2", seed=22, scale=5, tokenizer=False, vocab_size=VOCAB, eos_token_id=None)
    return target, draft


def exact_joint(engine, prompt, params):
    """P(x1, x2) of plain sampling from the target, computed from its logits (after the request's logit bias and
    penalties, x1 counted as output for x2)."""
    from paraspec.sampling import adjust_logits, logits_to_probs

    model = engine.target
    p1 = logits_to_probs(adjust_logits(model.prefill(prompt), params, prompt), params)
    joint = np.zeros((VOCAB, VOCAB))
    for x1 in range(VOCAB):
        p2 = logits_to_probs(adjust_logits(model.prefill(prompt + [x1]), params, prompt, [x1]), params)
        joint[x1] = p1[x1].item() * p2.double().cpu().numpy()
    return joint / joint.sum()


def assert_matches(counts, joint):
    expected = joint.ravel() * counts.sum()
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0
    keep = expected > 0
    assert chisquare(observed[keep], expected[keep] / expected[keep].sum() * observed.sum()).pvalue > 1e-3


# -- the adaptive rule on injected costs: a test that needs drafts must not hang on the machine's load ---------


def inject_flat_costs(engine) -> None:
    """Make an adaptive engine's rule see every forward width as equally cheap, whatever it measures: the target's
    at 10 ms, a draft model's at 1 ms: verification of any length pays and a draft model's step is a tenth of the
    target's, so the rule drafts wherever the acceptance estimate is worth it (its decisions stay the rule's; only
    the costs are fixed). (A draft model as costly as the target could never pay: the rule would not even try it.)"""
    inject_costs(engine, {1: 0.01, 4096: 0.01}, {1: 0.001, 4096: 0.001})


def inject_costs(engine, target: dict, draft: dict) -> None:
    """Give an adaptive engine's rule these forward costs (seconds by width) for the target and every draft
    model, kept whatever the rounds measure."""
    from paraspec.drafters.adaptive import ForwardCost

    class Fixed(ForwardCost):
        def observe(self, width: int, seconds: float) -> float:  # not refined by what the rounds measure
            return 1.0

        def rescale(self, level: float) -> None:  # nor by the target's level
            pass

    assert engine.max_num_seqs == 1, (
        "inject_costs sets the Engine's own policy: pass max_num_seqs=1 (a batched "
        "Engine's requests build a policy per sequence)"
    )
    policy = engine.strategy.policy
    policy.cost = Fixed(target)
    policy.draft_costs = {i: Fixed(draft) for i in policy.draft_costs}


# -- processes: what a test that kills or interrupts workers checks ---------------------------------------


def gone(pid: int) -> bool:
    path = Path(f"/proc/{pid}/status")
    return not path.exists() or "zombie" in path.read_text()


def children_of(pid: int) -> list[int]:
    children = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return children


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def spawned_workers(pid: int, with_server: bool = False) -> list[int]:
    """The worker processes `pid` started: spawned children, or the children of its fork server
    (runtime/workers.worker_start_method); with_server: the fork server too, once it has a worker."""
    workers, servers = [], []
    for child in children_of(pid):
        command = command_of(child)
        if "spawn_main" in command:
            workers.append(child)
        elif "multiprocessing.forkserver" in command:
            servers.append(child)
            workers += children_of(child)
    return workers + servers if with_server and workers else workers


def wait_for(predicate, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def error_while_running(request, fault, started_s: float = 0.5, limit_s: float = 60.0):
    """Run request() back to back in a thread (one may end early), call fault() once it has run `started_s`,
    and return (the error request() raised, seconds from the fault to that error); (None, None) if none came."""
    import threading

    outcome = {}

    def keep_requesting():
        end = time.monotonic() + limit_s
        try:
            while time.monotonic() < end:
                request()
        except BaseException as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=keep_requesting)
    thread.start()
    time.sleep(started_s)
    faulted = time.monotonic()
    fault()
    thread.join(limit_s)
    return outcome.get("error"), (outcome["at"] - faulted if "at" in outcome else None)
