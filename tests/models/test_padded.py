"""The padded forward (models/native/padded.py): padded to W rows, a token's logits are the same bits whatever its
forward carried; it computes what the dynamic forward computes; "auto" measures W once per model and device."""

import json

import pytest
import torch

from paraspec import Engine
from paraspec.models.loader import load_model, load_native
from paraspec.models.native.padded import check_width, choose_width, measured_width
from tests.conftest import ON_CUDA, TEST_DEVICE, needs_cuda

FAMILIES = ["qwen2_target", "llama_target", "mistral_target"]  # mistral: a sliding window of 16


def native(folder, width, graph=None, compile_step=False):
    return load_native(
        folder, torch.float32, device=TEST_DEVICE, padded_width=width, graph=graph, compile_step=compile_step
    )


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_is_the_same_bits_whatever_its_forward_carried(family, width, request):
    """Decoding one token at a time, verifying a chunk, a rollback and a chunk again: each token's logits are
    bitwise those of any other split -- what makes sd's verification agree with ar's steps on a GPU."""
    assert_rows_independent_of_the_split(native(request.getfixturevalue(family), width))


# compiling costs tens of seconds a model on a CPU: one family there, every family on a GPU
@pytest.mark.parametrize("family", FAMILIES if ON_CUDA else FAMILIES[:1])
def test_a_compiled_step_keeps_rows_independent_of_the_split(family, request):
    """torch.compile's fused kernels at the one fixed shape: a row's logits still depend on that row alone, and
    they compute the eager step's numbers (to float rounding: other kernels)."""
    folder = request.getfixturevalue(family)
    compiled = native(folder, 8, compile_step=True)
    assert compiled.padded.compiled
    assert_rows_independent_of_the_split(compiled)
    ids = list(range(5, 45))
    compiled.rollback(0)
    assert (compiled.forward(ids).cpu() - native(folder, 8).forward(ids).cpu()).abs().max() < 1e-3


def assert_rows_independent_of_the_split(model):
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = model.forward(ids)  # one call: ceil(40 / W) padded steps
    model.prefill(ids[:17])
    singles = torch.stack([model.forward([t])[-1] for t in ids[17:23]])
    chunk = model.forward(ids[23:31])
    model.rollback(20)
    again = model.forward(ids[20:40], last_n=5)
    assert model.length == 40
    assert torch.equal(singles, whole[17:23]) and torch.equal(chunk, whole[23:31])
    assert torch.equal(again, whole[35:40])


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_forward_computes_the_dynamic_forward(family, request):
    """The same numbers as the unpadded forward (to float rounding: other kernel shapes), windows included."""
    folder = request.getfixturevalue(family)
    ids = list(range(5, 60))
    dynamic, padded = native(folder, None), native(folder, 4)
    assert padded.padded_width == 4 and dynamic.padded_width is None
    assert (dynamic.forward(ids).cpu() - padded.forward(ids).cpu()).abs().max() < 1e-4


def test_a_tree_wider_than_w_sees_only_its_ancestors(qwen2_target):
    """A token tree of 7 nodes in steps of 3 rows: nodes of a later step see their ancestors from earlier steps
    (by then in the cache) and nothing else; every branch gets its own sequential logits."""
    prefix = [10, 11, 12, 13]
    branches = [[20, 21, 22], [30, 31], [40, 41]]
    tokens, positions, parents = [], [], []
    for branch in branches:
        for depth, token in enumerate(branch):
            parents.append(-1 if depth == 0 else len(tokens) - 1)
            tokens.append(token)
            positions.append(len(prefix) + depth)
    n = len(tokens)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    model = native(qwen2_target, 3)
    model.prefill(prefix)
    tree = model.forward(tokens, positions=positions, tree_mask=mask)
    reference = native(qwen2_target, None)
    start = 0
    for branch in branches:
        reference.prefill(prefix)
        sequential = reference.forward(branch)
        assert (tree[start : start + len(branch)].cpu() - sequential.cpu()).abs().max() < 1e-4
        start += len(branch)


def test_choose_width_takes_the_widest_free_padding():
    assert choose_width({1: 1.0, 2: 1.0, 4: 1.05, 8: 1.1, 16: 1.6, 32: 3.0}) == 8
    assert choose_width({1: 1.0, 2: 2.0}) == 1
    assert choose_width({4: 0.9, 8: 1.0, 1: 1.2}) == 8  # noise: a wider width measured cheaper
    with pytest.raises(ValueError):
        choose_width({})


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "wide"])
def test_bad_padded_width_names_the_choices(bad):
    with pytest.raises(ValueError, match="padded_width must be an integer >= 1, 'auto'"):
        check_width(bad)


def test_padded_width_is_for_the_native_backend(tmp_path):
    """Refused when the configuration is checked, before any model is read."""
    with pytest.raises(ValueError, match="padded_width=4 pads the native decoder's forwards.*backend='native'"):
        Engine(str(tmp_path / "model.gguf"), strategy="ar", backend="llamacpp", padded_width=4)


def test_compile_step_needs_the_padded_step(tmp_path, qwen2_target):
    for backend, width in (("llamacpp", "auto"), ("hf", "auto"), ("native", None)):
        with pytest.raises(ValueError, match="compile_step=True compiles the native decoder's padded step"):
            Engine(str(tmp_path / "model.gguf"), strategy="ar", backend=backend, padded_width=width, compile_step=True)
    with pytest.raises(ValueError, match="compile_step compiles the padded step: pass padded_width=W"):
        native(qwen2_target, None, compile_step=True)
    with pytest.raises(
        ValueError, match="compile_step compiles the native decoder's padded step, not the 'hf' backend's"
    ):
        load_model(qwen2_target, "float32", backend="hf", compile_step=True)


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU defaults")
def test_auto_is_off_on_cpu_and_graphs_need_cuda(qwen2_target):
    assert native(qwen2_target, "auto").padded_width is None
    with pytest.raises(ValueError, match="graph=True captures a CUDA graph"):
        native(qwen2_target, 4, graph=True)


def test_auto_width_is_measured_once_and_shared(qwen2_target, tmp_path, monkeypatch):
    """The measurement is remembered per model shape and device: a second load (another worker) reads it, so
    every process pads alike however noisy its own timing would have been."""
    import paraspec.models.native.padded as padded_module

    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    measured = []

    def cost(model, width, graph=None, repeats=20):
        measured.append(width)
        return {1: 2.0, 2: 2.0, 4: 2.1, 8: 2.2, 16: 4.0, 32: 8.0}[width]

    monkeypatch.setattr(padded_module, "forward_cost_ms", cost)
    model = native(qwen2_target, None)
    assert measured_width(model) == 8 and sorted(measured) == list(padded_module.WIDTHS)
    measured.clear()
    assert measured_width(native(qwen2_target, None)) == 8 and measured == []
    record = json.loads(next((tmp_path / "padded_width").glob("*.json")).read_text())
    assert record["width"] == 8 and record["costs_ms"]["16"] == 4.0


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_equals_eager(family, request):
    """On CUDA: the captured graph computes the eager step's bits."""
    folder = request.getfixturevalue(family)
    ids = list(range(5, 45))
    graphed, eager = native(folder, 8, graph=True), native(folder, 8, graph=False)
    assert graphed.padded.graphed and not eager.padded.graphed
    assert torch.equal(graphed.forward(ids), eager.forward(ids))
