"""runtime.devices.sync, and every timer of device work waiting for the device before it reads its clock.

Without a GPU, tests/fake_cuda.py stands in for one: QueuedModel's forwards queue work on a fake cuda:0,
torch.cuda.synchronize is recorded, and a clock read that finds work still queued fails the check (on a GPU that
timer would measure the launch of the kernels, not the kernels). And lend_cores: a block on more cores, given back;
shared_cores: which cores a prompt may borrow.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from paraspec.runtime.devices import (
    Device,
    _parse_local,
    available_cores,
    current_pinning,
    lend_cores,
    set_pinning,
    shared_cores,
    sync,
)
from tests.fake_cuda import QueuedModel, Timeline, fake_cuda


@pytest.mark.parametrize("device", ["cuda:1", "NODE/cuda:1", Device("cuda", index=1), torch.device("cuda", 1)])
def test_sync_waits_for_the_gpu_named(monkeypatch, device):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    sync(device)
    assert [torch.device("cuda", w) if isinstance(w, int) else w for w in waited] == [torch.device("cuda", 1)]


@pytest.mark.parametrize("device", ["cpu", "cpu:0-1", Device("cpu", cores=(0,)), torch.device("cpu"), None])
def test_sync_on_the_cpu_does_nothing(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronized the CPU"))
    sync(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_on_a_real_gpu_returns_when_its_work_is_done():
    x = torch.randn(2048, 2048, device="cuda:0")
    for _ in range(8):
        x = x @ x
        x = x / x.norm()
    sync("cuda:0")
    assert torch.cuda.current_stream(0).query()


# -- the timers -------------------------------------------------------------------------------------------------


def measure_forward_cost(model):
    from paraspec.drafters.adaptive import ForwardCost

    ForwardCost.measure(model, [1, 2])


def profile_forwards(model):
    from paraspec.bench.pair_profile import time_forwards

    time_forwards(model, [1, 2, 3], widths=(1, 2))


def profile_generation(model):
    from paraspec.bench.pair_profile import time_generation

    time_generation(model, [1, 2, 3], 4)


def draft_a_chain(model):
    """ModelDrafter times each draft forward (the adaptive rule's draft costs)."""
    from paraspec.drafters.model import ModelDrafter
    from paraspec.sampling import SamplingParams, make_generator

    drafter = ModelDrafter(model, model.vocab_size)
    drafter.propose([1, 2, 3], 3, SamplingParams(), make_generator(0))
    assert len(drafter.timings) == 3


def decode_ar(model):
    """ar's prefill and decode events (RequestState.timed)."""
    from paraspec.request_state import RequestState
    from paraspec.sampling import SamplingParams, make_generator
    from paraspec.strategies.ar import AR

    strategy = AR({})
    strategy.target = model
    run = RequestState([1, 2, 3], SamplingParams(max_new_tokens=3), frozenset(), make_generator(0), model.max_context)
    assert sum(list(strategy.decode(run)), []) == [3, 3, 3]
    assert {e.kind for e in run.trace.events} == {"prefill", "decode"}


def serve_a_dsi_chunk(model):
    """A dsi target server's prefill/verify event (Trace.span in the worker)."""
    from paraspec.strategies.dsi import serve_chunk
    from paraspec.trace import Trace

    ctx = SimpleNamespace(trace=Trace(), device=Device("cuda"))
    serve_chunk(model, ctx, 0, [1, 2, 3], 2, send_logits=False, margins=False)
    assert [e.kind for e in ctx.trace.events] == ["prefill"]


@pytest.mark.parametrize(
    "timer",
    [measure_forward_cost, profile_forwards, profile_generation, draft_a_chain, decode_ar, serve_a_dsi_chunk],
    ids=lambda f: f.__name__,
)
def test_timers_of_gpu_work_wait_for_the_gpu(monkeypatch, timer):
    timeline = Timeline(monkeypatch)
    with fake_cuda(timeline.events):
        timer(QueuedModel(timeline))
    assert timeline.unsynced_clocks() == 0, timeline.events


# -- set-up work where the steps run ----------------------------------------------------------------------------


def test_the_forward_costs_are_timed_where_the_steps_run(monkeypatch):
    """The costs are timed by the strategy's on_step_thread (the Engine sets it: the request's own thread, or the
    Scheduler's, tests/strategies/test_batched.py), once per model."""
    from types import SimpleNamespace

    from paraspec.drafters import adaptive
    from paraspec.strategies.base import LocalStrategy

    ran, timed = [], []

    def measure(model, widths, context=32, repeats=2, last_only=False):
        timed.append(widths)
        return adaptive.ForwardCost({w: 0.01 * w for w in widths})

    def on_step_thread(fn):
        ran.append(fn)
        return fn()

    monkeypatch.setattr(adaptive.ForwardCost, "measure", staticmethod(measure))
    owner = SimpleNamespace(cost_tables={}, on_step_thread=on_step_thread)
    cost = LocalStrategy.forward_cost(owner, "target", object(), [1, 2])
    assert cost.seconds == {1: 0.01, 2: 0.02} and set(owner.cost_tables) == {"target"}
    assert len(ran) == 1 and timed == [[1, 2]]
    LocalStrategy.forward_cost(owner, "target", object(), [1])  # known: not timed again
    assert len(ran) == 1 and len(timed) == 1


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores")
def test_lent_cores_run_a_block_on_them_and_give_back_the_threads_own():
    from paraspec.models.threads import lent_threads, own_threads

    cores = tuple(available_cores()[:2])
    before = current_pinning()
    try:
        set_pinning({cores[1]}, 1)
        assert (lent_threads(), own_threads()) == (None, 1)
        with lend_cores(cores):
            assert os.sched_getaffinity(0) == set(cores) and torch.get_num_threads() == 2
            assert (lent_threads(), own_threads()) == (2, 1)  # a model's prompt on 2, the rest on its own 1
        assert os.sched_getaffinity(0) == {cores[1]} and torch.get_num_threads() == 1
        assert (lent_threads(), own_threads()) == (None, 1)
        with lend_cores(None):  # nothing lent: the block as it is
            assert lent_threads() is None and torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), lend_cores(cores):
            raise RuntimeError("a failed prompt")
        assert os.sched_getaffinity(0) == {cores[1]} and (lent_threads(), own_threads()) == (None, 1)
    finally:
        set_pinning(*before)


def test_cores_that_cannot_be_lent_leave_the_block_as_it_is(monkeypatch):
    """A cpuset narrower than the machine's (a container, a Ray worker): the prompt runs on the thread's own cores."""
    from paraspec.models.threads import lent_threads

    before = current_pinning()

    def refuse(pid, cores):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with lend_cores((0, 1)):
        assert lent_threads() is None and current_pinning() == before
    assert current_pinning() == before


@pytest.mark.parametrize(
    "devices, kind, cores",
    [
        (["cpu:1", "cpu:0"], "process", (0, 1)),
        (["cpu:2-3", "cpu:0,1"], "process", (0, 1, 2, 3)),
        (["cpu:0-1", "cpu:1"], "process", (0, 1)),  # the second worker gains a core
        (["cpu:1", "cpu:1"], "process", None),  # nothing to lend
        (["cpu", "cpu:0"], "process", None),  # unpinned: the first has every core already
        (["cuda:0", "cpu:0"], "process", None),
        (["a/cpu:1", "b/cpu:0"], "ray", None),  # two machines
        (["cpu:1", "cpu:0"], "ray", None),  # Ray may put them on two machines
        (["a/cpu:1", "a/cpu:0"], "ray", (0, 1)),
        (["cpu:1", "cpu:0", "cpu:0"], "process", (0, 1)),  # dsi: two servers and a drafter
    ],
)
def test_shared_cores_are_lent_only_on_one_machine_where_a_worker_gains(devices, kind, cores):
    def device(text: str) -> Device:  # parse_device's syntax, without checking this machine's cores or GPUs
        node, _, local = text.rpartition("/")
        return _parse_local(local, text, node or None)

    assert shared_cores([device(d) for d in devices], kind) == cores
