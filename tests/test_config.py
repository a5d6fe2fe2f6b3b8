"""EngineConfig checks what a configuration asks against its strategy's declared Capabilities: a strategy that
declares them is checked with no edit to config.py, and every refusal names the fix and the strategies that
accept what was asked."""

from __future__ import annotations

import pytest

from paraspec.config import EngineConfig
from paraspec.models.simulated import SimulatedSpec
from paraspec.strategies import register, unregister
from paraspec.strategies.base import Capabilities, LocalStrategy

TARGET = SimulatedSpec(seed=1)
DRAFT = SimulatedSpec(role="draft", seed=1)


class Plain(LocalStrategy):
    """Decodes the target alone, on the native backend only: declared, never run."""

    name = "test-plain"
    caps = Capabilities(drafts="none", backends=("native",), why_not_across_nodes="it is a test")

    def decode(self, run, seat=None):
        raise AssertionError("never decoded")


class Pair(LocalStrategy):
    """Takes several drafts and model-free ones: declared, never run."""

    name = "test-pair"
    caps = Capabilities(drafts="several", model_free=True)

    def decode(self, run, seat=None):
        raise AssertionError("never decoded")


@pytest.fixture
def registered():
    register(Plain)
    register(Pair)
    yield
    unregister(Plain.name)
    unregister(Pair.name)


def test_a_new_strategy_is_checked_by_its_declaration_alone(registered):
    with pytest.raises(
        ValueError,
        match="strategy 'test-plain' decodes the target alone and takes no draft.*"
        r"pick a speculative strategy \(sd, amusd, dsi, tree, easyspec, test-pair\)",
    ):
        EngineConfig(TARGET, DRAFT, strategy=Plain.name)
    with pytest.raises(
        ValueError,
        match="strategy 'test-plain' runs on the native backend, not 'hf'; pass "
        "backend='native'.*runs on hf \\(ar, sd, amusd, dsi, test-pair\\)",
    ):
        EngineConfig(TARGET, strategy=Plain.name, backend="hf")
    with pytest.raises(
        ValueError,
        match="runtime_kind='ray' does not apply to it; pass runtime_kind='process'.*"
        r"\(amusd, dsi, easyspec\)",
    ):
        EngineConfig(TARGET, strategy=Plain.name, runtime_kind="ray")
    with pytest.raises(ValueError, match=r"cannot run across nodes \(it is a test\).*use amusd, dsi to place"):
        EngineConfig(TARGET, strategy=Plain.name, target_devices=["box-a/cpu:0"])
    assert EngineConfig(TARGET, strategy=Plain.name).model_backend == "native"


def test_a_new_strategy_is_named_where_it_accepts_what_another_refuses(registered):
    with pytest.raises(
        ValueError,
        match=r"strategy 'ar' decodes the target alone .*\(sd, amusd, dsi, tree, "
        r"easyspec, test-pair\)",
    ):
        EngineConfig(TARGET, DRAFT, strategy="ar")
    with pytest.raises(ValueError, match="takes one draft model, got 2; only sd, dsi, tree, test-pair takes several"):
        EngineConfig(TARGET, [DRAFT, DRAFT], strategy="amusd")
    with pytest.raises(
        ValueError,
        match="needs a draft model, not 'ngram': its draft worker overlaps.*model-free "
        "drafters run with sd, dsi, tree, test-pair",
    ):
        EngineConfig(TARGET, "ngram", strategy="amusd")
    with pytest.raises(
        ValueError,
        match="strategy 'test-pair' needs a draft model; pass draft=.*decode the target alone with ar, test-plain",
    ):
        EngineConfig(TARGET, strategy=Pair.name)
    assert EngineConfig(TARGET, ["ngram", DRAFT], strategy=Pair.name).draft_checkpoints == [DRAFT]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(drafts="two"), "Capabilities\\(drafts='two'\\)"),
        (dict(drafts="none", model_free=True), "model_free=True\\) takes drafts"),
    ],
)
def test_a_declaration_that_cannot_hold_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Capabilities(**kwargs)
