"""Report arithmetic on hand-built records: medians, paired speedups, pooled acceptance, token checks."""

import pytest

from paraspec.bench.metrics import (
    Variant,
    busy_fraction,
    check_tokens,
    first_divergence,
    paired_speedup,
    pooled_acceptance,
    reference_variant,
    summarize,
)
from paraspec.bench.plots import idle_gaps
from paraspec.trace import Trace
from tests.bench.conftest import record, stats

AR, SD, HFA = Variant("ar", 1), Variant("sd", 1), Variant("hf-assisted", 1)


def test_variant_names():
    assert Variant("ar").name == "ar" and Variant("sd", 2).name == "sd@2t"


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopped early: differs where it ended
    assert first_divergence([], []) is None


def test_check_tokens_reports_both_margins():
    ref = record(AR, 0, [5, 6, 7, 8], stats(4, 1.0), margins={0: 3.0, 1: 2.0, 2: 0.01, 3: 1.0})
    same = record(SD, 0, [5, 6, 7, 8], stats(4, 1.0), margins={0: 3.0, 1: 2.0, 2: 0.02})
    other = record(SD, 0, [5, 6, 9, 8], stats(4, 1.0), margins={0: 3.0, 1: 2.0, 2: 0.02})
    assert check_tokens(ref, same) is None
    d = check_tokens(ref, other)
    assert (d.prompt_id, d.index, d.reference_token, d.token) == ("p0", 2, 7, 9)
    assert (d.reference_margin, d.margin) == (0.01, 0.02)
    shorter = check_tokens(ref, record(SD, 0, [5, 6], stats(2, 1.0)))
    assert (shorter.index, shorter.reference_token, shorter.token, shorter.margin) == (2, 7, None, None)


def test_paired_speedup_is_the_median_of_per_prompt_ratios():
    ar = [record(AR, i, [1], stats(10, s)) for i, s in enumerate([1.0, 2.0, 4.0])]  # 100, 200, 400 ms/token
    sd = [record(SD, i, [1], stats(10, s)) for i, s in enumerate([0.5, 2.5, 1.0])]  # ratios 2, 0.8, 4
    assert paired_speedup(ar, sd) == pytest.approx(2.0)
    # not the ratio of medians (200 / 100 = 2 too here, so check a case where they differ)
    sd2 = [record(SD, i, [1], stats(10, s)) for i, s in enumerate([0.25, 1.0, 8.0])]  # ratios 4, 2, 0.5
    assert paired_speedup(ar, sd2) == pytest.approx(2.0)
    assert paired_speedup(ar, sd2[:2]) == pytest.approx(3.0)  # only shared prompts
    assert paired_speedup([], sd) is None


def test_pooled_acceptance_sums_counts():
    a = stats(12, 1.0, drafted=10, accepted=8, rounds=4, speculative=True)  # 3 tokens per round
    b = stats(6, 1.0, drafted=10, accepted=2, rounds=6, speculative=True)  # 1 token per round
    acceptance, length = pooled_acceptance([a, b])
    assert acceptance == pytest.approx(10 / 20)
    assert length == pytest.approx(18 / 10)  # the mean of 3 and 1 would be 2
    c = stats(4, 1.0, drafted=30, accepted=3, rounds=1, speculative=True)
    assert pooled_acceptance([a, c])[0] == pytest.approx(11 / 40)  # mean of ratios would be 0.45
    assert pooled_acceptance([stats(5, 1.0)]) == (None, None)
    plain = stats(5, 1.0, drafted=0, accepted=0, rounds=5, speculative=True)  # the rule drafted nothing
    assert pooled_acceptance([plain]) == (None, pytest.approx(1.0))  # no rate: nothing was judged


def test_summarize_table_figures():
    ar = [record(AR, i, [1, 2, 3], stats(10, s)) for i, s in enumerate([1.0, 3.0, 2.0])]
    sd = [
        record(
            SD,
            i,
            [1, 2, 3] if i else [1, 4, 3],
            stats(10, s, drafted=10, accepted=5, rounds=5, draft_s=0.2, verify_s=0.3, speculative=True),
            margins={1: 0.5},
        )
        for i, s in enumerate([0.5, 1.0, 1.0])
    ]
    hfa = [
        record(HFA, i, [1, 2, 3], stats(10, s, drafted=10, accepted=10, rounds=2, speculative=True))
        for i, s in enumerate([1.0, 2.0, 1.0])
    ]
    ar[0].margins = {1: 0.25}
    rows = {r["variant"]: r for r in summarize(ar + sd + hfa, [AR, SD, HFA], greedy=True)}
    assert rows["ar@1t"]["ms_per_token"] == pytest.approx(200.0)  # median of 100, 300, 200
    assert rows["ar@1t"]["tokens_per_s"] == pytest.approx(5.0)
    assert rows["ar@1t"]["ttft_ms"] == pytest.approx(100.0)
    assert rows["ar@1t"]["acceptance_rate"] is None
    assert rows["sd@1t"]["ms_per_token"] == pytest.approx(100.0)
    assert rows["sd@1t"]["speedup_vs_ar"] == pytest.approx(2.0)  # ratios 2, 3, 2
    assert rows["sd@1t"]["speedup_vs_hf_assisted"] == pytest.approx(2.0)  # ratios 2, 2, 1
    assert rows["sd@1t"]["acceptance_rate"] == pytest.approx(0.5)
    assert rows["sd@1t"]["mean_accepted_length"] == pytest.approx(2.0)
    assert rows["sd@1t"]["draft_s_per_100_tokens"] == pytest.approx(100 * 0.6 / 30)
    assert rows["sd@1t"]["verify_s_per_100_tokens"] == pytest.approx(100 * 0.9 / 30)
    assert rows["sd@1t"]["identical"] == 2 and rows["sd@1t"]["compared"] == 3
    assert rows["sd@1t"]["divergences"] == [
        {"prompt_id": "p0", "index": 1, "reference_token": 2, "token": 4, "reference_margin": 0.25, "margin": 0.5}
    ]
    assert rows["hf-assisted@1t"]["identical"] == 3
    assert rows["ar@1t"]["identical"] is None and rows["ar@1t"]["reference"] == "ar@1t"
    assert summarize(ar + sd, [AR, SD], greedy=False)[1]["identical"] is None  # sampling: no token check


def test_thread_variants_compare_with_ar_at_the_same_threads():
    ar1, ar2, sd2 = Variant("ar", 1), Variant("ar", 2), Variant("sd", 2)
    variants = [ar1, ar2, sd2]
    assert reference_variant(sd2, variants, "ar") == ar2
    assert reference_variant(Variant("sd", 4), variants, "ar") == ar1  # none at 4 threads: the first
    records = [
        record(ar1, 0, [1, 2], stats(10, 4.0)),
        record(ar2, 0, [1, 3], stats(10, 2.0)),
        record(sd2, 0, [1, 2], stats(10, 1.0)),
    ]
    rows = {r["variant"]: r for r in summarize(records, variants, greedy=True)}
    assert rows["sd@2t"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert rows["sd@2t"]["speedup_vs_ar@1t"] == pytest.approx(4.0)
    assert rows["sd@2t"]["reference"] == "ar@2t" and rows["sd@2t"]["identical"] == 0
    assert rows["ar@2t"]["reference"] == "ar@1t" and rows["ar@2t"]["identical"] == 0


def test_busy_fraction_and_idle_gaps():
    trace = Trace()
    trace.add("draft", "draft", 0.0, 1.0)
    trace.add("target", "verify", 1.0, 3.0)
    trace.add("draft", "draft", 3.0, 3.5)
    trace.add("draft", "wait", 3.5, 4.0)
    assert busy_fraction(trace, 4.0) == {"draft": pytest.approx(0.375), "target": pytest.approx(0.5)}
    draft_work = [e for e in trace.events if e.device == "draft" and e.kind == "draft"]
    assert idle_gaps(draft_work, 4.0) == [(1.0, 3.0), (3.5, 4.0)]
    target_work = [e for e in trace.events if e.device == "target"]
    assert idle_gaps(target_work, 3.0) == [(0.0, 1.0)]


def test_a_worker_strategy_compares_with_ar_on_the_same_number_of_cores():
    ar1, ar2, amusd = Variant("ar", 1), Variant("ar", 2), Variant("amusd")
    variants = [ar1, ar2, amusd]
    cores = {ar1: 1, ar2: 2, amusd: 2}  # amusd: draft on cpu:0, target on cpu:1
    records = [
        record(ar1, 0, [1, 2], stats(10, 3.0)),
        record(ar2, 0, [1, 2], stats(10, 2.0)),
        record(amusd, 0, [1, 2], stats(10, 1.0)),
    ]
    row = {r["variant"]: r for r in summarize(records, variants, greedy=True, cores=cores)}["amusd"]
    assert row["reference"] == "ar@2t" and row["identical"] == 1
    assert row["speedup_vs_ar"] == pytest.approx(2.0) and row["speedup_vs_ar@1t"] == pytest.approx(3.0)
    assert reference_variant(amusd, variants, "ar") == ar1  # without budgets: the first ar
