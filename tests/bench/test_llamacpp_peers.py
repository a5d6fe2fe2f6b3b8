"""The llama.cpp peers (llamacpp-ar, llamacpp-spec, llamacpp-ngram): llama-server on tiny GGUF files returns the
greedy tokens of
the same weights, honours the token budget and the end-of-generation token, reports its draft counts, and leaves
no process behind (after close, after an exception, after this process is killed).

Tests marked llamacpp_peer need llama.cpp's programs (`python scripts/build_llamacpp.py peer`; the fixture builds
them once, ~5-10 minutes on 2 cores). Nothing here times anything.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paraspec import Engine, SamplingParams
from paraspec.bench import llamacpp_peers
from paraspec.bench.llamacpp_peers import (
    LlamaCppPeer,
    LlamaServer,
    PeerError,
    gguf_file,
    ngram_args,
    parse_ngram_grid,
    parse_spec_grid,
    peer_binaries,
)
from tests.tiny_gguf import _bytes_to_unicode, tiny_vocab

PROMPTS = [
    "the return of fib",
    "Once upon a time",
    "import os",
    "x = 1",
    "class A:",
    "# comment",
    "lambda",
    "hello world",
    "def f():",
    "the the the",
    "def add(a, b):",
    "if x:",
    "fib(10)",
    "abc",
]
# llama.cpp's default kernels (f16 flash attention) round differently from fp32 PyTorch: measured on this tiny
# target, the two greedy decodings part only where the top-2 logit gap is below 0.01
CLEAR_GAP = 0.02
# llama.cpp ends generation at both chat end tokens; the tiny model's config lists only <|im_end|> as EOS
LLAMA_EOG = {tiny_vocab()[0].index(t) for t in ("<|endoftext|>", "<|im_end|>")}
BYTE_IDS = {b: tiny_vocab()[0].index(c) for b, c in _bytes_to_unicode().items()}
REPO = Path(__file__).resolve().parents[2]


def server_pids(binaries: Path, parent: int | None = None) -> set[int]:
    """llama-server processes of `binaries` that are children of `parent` (default: this process) and still
    exist, zombies included."""
    parent = os.getpid() if parent is None else parent
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if cmd == str(binaries / "llama-server") and ppid == parent:
                pids.add(int(entry.name))
    return pids


def wait_gone(pid: int, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def binaries():
    return peer_binaries(build=True)


@pytest.fixture(scope="module")
def reference(gguf_pair):
    """paraspec's native ar on the target's weights in fp32 (an HF folder of the same weights)."""
    with Engine(gguf_pair["target_hf"], strategy="ar", dtype="float32", backend="native") as ar:
        yield ar


@pytest.fixture(scope="module")
def clear_prompts(reference):
    """{prompt: the reference's greedy tokens (24 at most, ending at llama.cpp's first end-of-generation token)}
    for the prompts whose greedy decoding has no near-tie."""
    out = {}
    for prompt in PROMPTS:
        result = reference.generate(encode(prompt), SamplingParams(max_new_tokens=24), record_margins=True)
        end = next((i + 1 for i, t in enumerate(result.token_ids) if t in LLAMA_EOG), len(result.token_ids))
        if min(result.margins[i] for i in range(end)) >= CLEAR_GAP:
            out[prompt] = result.token_ids[:end]
    assert len(out) >= 4 and any(len(tokens) < 24 for tokens in out.values())
    return out


@pytest.fixture(scope="module")
def peers(binaries, gguf_pair):
    ar = LlamaCppPeer("llamacpp-ar", gguf_pair["target"], threads=1, binaries=binaries)
    spec = LlamaCppPeer(
        "llamacpp-spec", gguf_pair["target"], gguf_pair["draft"], threads=1, binaries=binaries, spec_grid=[(4, 0.0)]
    )
    # lookups of 2 tokens drafting up to 4: short enough to match in the tiny model's short outputs
    ngram = LlamaCppPeer(
        "llamacpp-ngram", gguf_pair["target"], threads=1, binaries=binaries, ngram_grid=[("ngram-simple", 2, 4)]
    )
    yield ar, spec, ngram
    for peer in (ar, spec, ngram):
        peer.close()
    assert not server_pids(binaries)


def encode(text: str) -> list[int]:
    """Token ids of the tiny GGUF vocabulary, one per byte (ids go to llama-server as they are)."""
    return [BYTE_IDS[b] for b in text.encode()]


# -- runs on llama-server ---------------------------------------------------------------------------------
@pytest.mark.llamacpp_peer
def test_greedy_tokens_equal_greedy_decoding_of_the_same_weights(peers, clear_prompts):
    params = SamplingParams(max_new_tokens=24)
    for prompt, expected in clear_prompts.items():
        for peer in peers:
            got = peer.generate(encode(prompt), params, record_margins=True)
            assert got.token_ids == expected, (peer.name, prompt)
            assert got.finish_reason == ("stop" if len(expected) < 24 else "length") and got.margins is None
            assert got.stats.new_tokens == len(expected) and got.stats.prompt_tokens == len(prompt)


@pytest.mark.llamacpp_peer
def test_budget_is_honoured_even_with_long_drafts(binaries, gguf_pair, reference):
    ids = encode("x = 1")
    spec = LlamaCppPeer(
        "llamacpp-spec", gguf_pair["target"], gguf_pair["draft"], threads=1, binaries=binaries, spec_grid=[(16, 0.0)]
    )
    try:
        for n in (1, 3, 7):
            got = spec.generate(ids, SamplingParams(max_new_tokens=n))
            assert len(got.token_ids) == n and got.finish_reason == "length"
            assert got.token_ids == reference.generate(ids, SamplingParams(max_new_tokens=n)).token_ids
    finally:
        spec.close()


@pytest.mark.llamacpp_peer
def test_stops_at_the_end_of_generation_token(peers, clear_prompts):
    prompt, expected = next((p, t) for p, t in clear_prompts.items() if len(t) < 24)
    assert expected[-1] in LLAMA_EOG
    for peer in peers:
        got = peer.generate(encode(prompt), SamplingParams(max_new_tokens=40))
        assert got.token_ids == expected, peer.name  # the stop token is included, as in ar
        assert got.finish_reason == "stop"


@pytest.mark.llamacpp_peer
def test_stats_carry_llamas_draft_counts(peers):
    ar, spec, _ = peers
    ids = encode("Once upon a time")
    plain = ar.generate(ids, SamplingParams(max_new_tokens=20)).stats
    assert plain.acceptance_rate is None and plain.drafted == 0 and plain.rounds == 0
    s = spec.generate(ids, SamplingParams(max_new_tokens=20)).stats
    assert s.drafted > 0 and 0 <= s.accepted <= s.drafted
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert s.rounds == 20 - 1 - s.accepted  # every verification yields its accepted drafts + 1
    assert 0 < s.ttft_s < s.total_s and s.tpot_ms > 0
    assert s.ms_per_token == pytest.approx(s.total_s * 1000 / 20)


@pytest.mark.llamacpp_peer
def test_ngram_drafts_from_the_context_without_a_draft_model(peers):
    ngram = peers[2]
    stats = [ngram.generate(encode(prompt), SamplingParams(max_new_tokens=40)).stats for prompt in PROMPTS]
    # (the server starts at the first request: its arguments are read after it, whatever ran before this test)
    assert ngram.draft_gguf is None and "-md" not in ngram.server.args
    assert " ".join(ngram.server.args).endswith(
        "--spec-type ngram-simple --spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 4"
    )
    assert sum(s.drafted for s in stats) > 0  # some outputs repeat a 2-gram of their context
    for s in stats:
        assert 0 <= s.accepted <= s.drafted and s.rounds == s.new_tokens - 1 - s.accepted
        assert s.drafted <= 4 * s.rounds  # at most m = 4 a round


@pytest.mark.llamacpp_peer
def test_sampling_takes_the_settings_and_the_seed(peers):
    ar = peers[0]
    ids = encode("import os")
    greedy = ar.generate(ids, SamplingParams(max_new_tokens=16)).token_ids
    params = SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=16, seed=3)
    first = ar.generate(ids, params).token_ids
    assert 1 <= len(first) <= 16 and ar.generate(ids, params).token_ids == first  # seeded
    draws = [ar.generate(ids, SamplingParams(temperature=1.5, max_new_tokens=16, seed=s)).token_ids for s in range(4)]
    assert any(d != greedy for d in draws)  # really sampling
    top1 = [
        ar.generate(ids, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=16, seed=s)).token_ids
        for s in range(2)
    ]
    assert top1 == [greedy, greedy]  # top-k reaches it


@pytest.mark.llamacpp_peer
def test_tuning_times_every_setting_and_keeps_the_fastest(binaries, gguf_pair, monkeypatch):
    spec = LlamaCppPeer(
        "llamacpp-spec",
        gguf_pair["target"],
        gguf_pair["draft"],
        threads=1,
        binaries=binaries,
        spec_grid=[(2, 0.0), (6, 0.5)],
    )
    notes, others = [], server_pids(binaries)  # the module's peers may be running
    monkeypatch.setattr(llamacpp_peers, "TUNE_TOKENS", 7)
    try:
        spec.tune([encode(PROMPTS[0]), encode(PROMPTS[1])], SamplingParams(max_new_tokens=100), progress=notes.append)
        grid = spec.settings["spec_grid"]
        assert [(g["draft_max"], g["p_min"]) for g in grid] == [(2, 0.0), (6, 0.5)]
        assert all(g["new_tokens"] == 2 * 7 for g in grid)  # two prompts, each cut at TUNE_TOKENS
        fastest = min(grid, key=lambda g: g["ms_per_token"])
        assert spec.setting == (fastest["draft_max"], fastest["p_min"])
        assert (spec.settings["draft_max"], spec.settings["p_min"]) == spec.setting
        assert spec.settings["tuned_on"] == {"prompts": 2, "max_new_tokens": 7}
        assert len(notes) == 2 and "draft max 6, p-min 0.5" in notes[1]
        assert server_pids(binaries) - others == {spec.server.proc.pid}  # the other setting's server is gone
        assert f"--spec-draft-n-max {spec.setting[0]}" in " ".join(spec.server.args)
    finally:
        spec.close()
    assert server_pids(binaries) == others


# -- no process left behind --------------------------------------------------------------------------------
@pytest.mark.llamacpp_peer
def test_server_is_pinned_and_stopped_on_close_and_on_exceptions(binaries, gguf_pair):
    core, before = sorted(os.sched_getaffinity(0))[-1], server_pids(binaries)
    with pytest.raises(KeyboardInterrupt):
        with LlamaServer(binaries, gguf_pair["target"], threads=1, cores=[core], context=256) as server:
            pid = server.proc.pid
            assert os.sched_getaffinity(pid) == {core}
            assert server_pids(binaries) - before == {pid}
            raise KeyboardInterrupt
    assert wait_gone(pid) and server_pids(binaries) == before
    server.close()  # twice is fine


@pytest.mark.llamacpp_peer
def test_a_server_that_cannot_start_says_why_and_is_gone(binaries, tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)
    before = server_pids(binaries)
    with pytest.raises(PeerError, match="exited with status .* its log ends with"):
        LlamaServer(binaries, bad, threads=1, context=256, start_timeout_s=60)
    assert server_pids(binaries) == before


@pytest.mark.llamacpp_peer
def test_server_dies_with_the_process_that_started_it(binaries, gguf_pair):
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from paraspec.bench.llamacpp_peers import LlamaServer\n"
        f"s = LlamaServer(Path({str(binaries)!r}), Path({str(gguf_pair['target'])!r}), threads=1, context=256)\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pid = int(child.stdout.readline())
        assert server_pids(binaries, parent=child.pid) == {pid}
    finally:
        child.send_signal(signal.SIGKILL)  # no finally, no atexit: the kernel's job
        child.wait()
    assert wait_gone(pid)


@pytest.mark.llamacpp_peer
def test_bench_runs_the_peers_and_reports_the_grid(binaries, gguf_pair, tmp_path):
    from paraspec.cli.main import main

    out, before = tmp_path / "bench", server_pids(binaries)
    code = main(
        [
            "bench",
            "--target",
            str(gguf_pair["target"]),
            "--draft",
            str(gguf_pair["draft"]),
            "--dtype",
            "float32",
            "--backend",
            "native",
            "--strategies",
            "ar,llamacpp-ar,llamacpp-spec,llamacpp-ngram",
            "--threads",
            "1",
            "--dataset",
            "humaneval",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "12",
            "--llamacpp-spec-grid",
            "2:0,4:0.5",
            "--llamacpp-ngram-grid",
            "ngram-simple:2:4,ngram-mod:3:8",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    table = (out / "report.md").read_text()
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in table.splitlines()
        if line.startswith("| ")
        and " | " in line
        and not line.startswith(("| strategy", "| draft max"))
        and "@" in line.split(" | ")[0]
    }
    assert list(rows) == ["ar@1t", "llamacpp-ar@1t", "llamacpp-spec@1t", "llamacpp-ngram@1t"]
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # @Nt: every core, as ar@Nt
    assert rows["llamacpp-ar@1t"][1] == f"cpu:{cores} (llama-server, 1 thread)" and rows["llamacpp-ar@1t"][2] == "1"
    for name in ("llamacpp-ar@1t", "llamacpp-spec@1t", "llamacpp-ngram@1t"):
        assert rows[name][-1].strip(" |") in ("0/2", "1/2", "2/2"), name  # compared with ar, shown as is
    assert "llama.cpp F32)" in table.splitlines()[0]
    assert "llamacpp-spec@1t: llama.cpp's draft settings, timed on 1 prompt(s) × 12 new tokens" in table
    results = json.loads((out / "results.json").read_text())["datasets"]["humaneval"]
    settings = results["variants"]["llamacpp-spec@1t"]["settings"]
    assert [(g["draft_max"], g["p_min"]) for g in settings["spec_grid"]] == [(2, 0.0), (4, 0.5)]
    ngram = results["variants"]["llamacpp-ngram@1t"]["settings"]
    assert [(g["spec_type"], g["size_n"], g["size_m"]) for g in ngram["spec_grid"]] == [
        ("ngram-simple", 2, 4),
        ("ngram-mod", 3, 8),
    ]
    kept = next(g for g in ngram["spec_grid"] if (g["spec_type"], g["size_n"]) == (ngram["spec_type"], ngram["size_n"]))
    assert kept["ms_per_token"] == min(g["ms_per_token"] for g in ngram["spec_grid"])
    assert "llamacpp-ngram@1t: llama.cpp's n-gram settings, timed on 1 prompt(s) × 12 new tokens" in table
    assert "| type | n | m | ms/token | acceptance |" in table
    records = [r for r in results["records"] if r["strategy"].startswith("llamacpp-")]
    assert len(records) == 6 and all(1 <= len(r["token_ids"]) <= 12 for r in records)
    assert server_pids(binaries) == before


# -- errors that name the fix (no build needed) ---------------------------------------------------------------
def test_a_model_without_a_gguf_names_the_fix(bench_target):
    with pytest.raises(ValueError, match="need a GGUF file for the draft .* pass a .gguf file as --draft"):
        gguf_file(bench_target, "draft")


def test_a_missing_build_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    with pytest.raises(PeerError, match=r"python scripts/build_llamacpp.py peer"):
        peer_binaries(build=False)


def test_ngram_grid_parsing_and_server_flags():
    assert parse_ngram_grid("ngram-simple:4:16, ngram-mod:24:64") == [("ngram-simple", 4, 16), ("ngram-mod", 24, 64)]
    for bad in ("", "ngram-simple:4", "ngram-simple:4:x", "draft-simple:4:16", "ngram-map-k:0:16", "ngram-mod:4:16:2"):
        with pytest.raises(ValueError):
            parse_ngram_grid(bad)
    assert ngram_args(("ngram-map-k4v", 8, 24)) == [
        "--spec-type",
        "ngram-map-k4v",
        "--spec-ngram-map-k4v-size-n",
        "8",
        "--spec-ngram-map-k4v-size-m",
        "24",
    ]
    assert ngram_args(("ngram-mod", 24, 64)) == [
        "--spec-type",
        "ngram-mod",
        "--spec-ngram-mod-n-match",
        "24",
        "--spec-ngram-mod-n-max",
        "64",
        "--spec-ngram-mod-n-min",
        "48",
    ]


def test_spec_grid_parsing():
    assert parse_spec_grid("4:0, 8:0.5,16") == [(4, 0.0), (8, 0.5), (16, 0.0)]
    for bad in ("", "x:1", "0:0.5", "4:1.5"):
        with pytest.raises(ValueError):
            parse_spec_grid(bad)


def test_peer_names_are_bench_variants():
    from paraspec.bench.runner import parse_variants

    names = [v.name for v in parse_variants("ar,llamacpp-ar,llamacpp-spec@2t,llamacpp-ngram", [1])]
    assert names == ["ar@1t", "llamacpp-ar@1t", "llamacpp-spec@2t", "llamacpp-ngram@1t"]
    with pytest.raises(ValueError, match="llamacpp-spec needs a draft"):
        LlamaCppPeer("llamacpp-spec", "x.gguf")


def test_the_peer_is_labelled_with_the_crash_fixes_it_was_built_with(tmp_path):
    from paraspec.bench.llamacpp_peers import peer_build_label

    (tmp_path / "bin").mkdir()
    assert peer_build_label(tmp_path / "bin") == "llama.cpp default build"  # no build.json: nothing claimed
    (tmp_path / "build.json").write_text('{"patches": ["llamacpp-0.3.36-fix-amx-tile-config.patch"]}')
    assert peer_build_label(tmp_path / "bin") == "llama.cpp default build + crash fix amx-tile-config"
