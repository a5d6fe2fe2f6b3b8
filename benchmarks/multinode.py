"""amusd and dsi across the nodes of a Ray cluster: what the network transport costs, and whether the event
simulator predicts the runtime at a given link latency.

The cluster is `ray.cluster_utils.Cluster` on this machine (a head and one node per worker, each named by a custom
resource), and every worker is placed on its own node with the network transport forced (`transport="tcp"`):
every channel call and every worker request crosses TCP. Models are simulated (`SimulatedSpec`): known answers
and forward times, so the figures are the runtime's, not a model's.

  overhead   ms per token with zero-latency models, shared memory (process workers) vs the network transport
             (Ray workers on separate nodes): the orchestration cost per token (goal: < 1 ms for amusd and for
             dsi with 4 servers)
  latency    measured ms/token at link latencies 0, 1 and 5 ms per message (`link_latency_ms`), beside the event
             simulator with the same link (sim/events.py: remote drafter and servers); ratio 1.00 = predicted
  messages   channel calls per draft token and per verification as the runtime makes them (the counts behind
             sim/events.py's DRAFT_MESSAGES and AMUSD_VERIFY_MESSAGES)

    .venv/bin/python benchmarks/multinode.py overhead --tokens 200 --repeats 3
    .venv/bin/python benchmarks/multinode.py latency --tokens 100 --repeats 3
    .venv/bin/python benchmarks/multinode.py messages
"""

from __future__ import annotations

import argparse
import statistics
import time

from paraspec import Engine, SamplingParams
from paraspec.models.simulated import SimulatedSpec
from paraspec.sim.costs import ForwardCost
from paraspec.sim.events import Setup, mean_result

PROMPT = [5, 6, 7]
DRAFTER_CALLS = ("read_since", "publish_and_read", "wait_below_ahead", "wait_for_room", "wait_for_version_change")


def start_cluster(nodes: int):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node0": 1}})
    for i in range(1, nodes):
        cluster.add_node(num_cpus=1, resources={f"node{i}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def engine_for(
    strategy: str,
    servers: int,
    target_s: float,
    draft_s: float,
    a: float,
    lookahead: int,
    network: bool,
    link_ms: float = 0.0,
) -> Engine:
    """Each worker on its own node (network) or each in its own local process (shared memory)."""
    cost = lambda s: ForwardCost.constant(s) if s > 0 else None  # None: no latency at all
    target = SimulatedSpec(cost=cost(target_s), seed=0)
    draft = SimulatedSpec(role="draft", cost=cost(draft_s), seed=0, draft_seed=1, acceptance_rate=a)
    n = servers if strategy == "dsi" else 1
    if network:
        placement = dict(
            runtime_kind="ray",
            transport="tcp",
            link_latency_ms=link_ms,
            draft_devices=["node0/cpu"],
            target_devices=[f"node{i + 1}/cpu" for i in range(n)],
        )
    else:
        placement = dict(runtime_kind="process", draft_devices=["cpu"], target_devices=["cpu"] * n)
    options = (
        dict(lookahead=lookahead, max_ahead=(n + 1) * lookahead)
        if strategy == "dsi"
        else dict(max_ahead=2 * lookahead, verify_chunk=2 * lookahead)
    )
    return Engine(target, draft, strategy=strategy, **placement, **options)


def ms_per_token(engine: Engine, tokens: int, repeats: int) -> float:
    engine.generate(PROMPT, SamplingParams(max_new_tokens=8))  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = engine.generate(PROMPT, SamplingParams(max_new_tokens=tokens))
        runs.append((time.perf_counter() - start) * 1000 / len(result.token_ids))
    return statistics.median(runs)


def part_overhead(tokens: int, repeats: int) -> None:
    print(
        f"orchestration cost per token, zero-latency simulated models, a = 0.8, lookahead 3, {tokens} tokens, "
        f"median of {repeats}"
    )
    print(f"{'strategy':<14} {'shared memory ms/token':>23} {'network ms/token':>17}")
    for strategy, servers in (("amusd", 1), ("dsi", 1), ("dsi", 4)):
        row = []
        for network in (False, True):
            with engine_for(strategy, servers, 0.0, 0.0, 0.8, 3, network) as engine:
                row.append(ms_per_token(engine, tokens, repeats))
        name = strategy if strategy == "amusd" else f"dsi N={servers}"
        print(f"{name:<14} {row[0]:>23.2f} {row[1]:>17.2f}")


def part_latency(tokens: int, repeats: int, target_ms: float, draft_ms: float, a: float) -> None:
    print(
        f"measured vs event simulator, target {target_ms} ms, draft {draft_ms} ms per forward, a = {a}, "
        f"lookahead 3, every worker on its own node, {tokens} tokens, median of {repeats}"
    )
    print(f"{'strategy':<10} {'link ms':>8} {'measured ms/token':>18} {'simulated':>10} {'ratio':>6}")
    for strategy, servers in (("amusd", 1), ("dsi", 2)):
        for link_ms in (0.0, 1.0, 5.0):
            with engine_for(strategy, servers, target_ms / 1000, draft_ms / 1000, a, 3, True, link_ms) as engine:
                measured = ms_per_token(engine, tokens, repeats)
            n = servers if strategy == "dsi" else 1
            setup = Setup(
                strategy,
                target=ForwardCost.constant(target_ms / 1000),
                draft=ForwardCost.constant(draft_ms / 1000),
                acceptance_rate=a,
                lookahead=3,
                servers=n,
                max_ahead=(n + 1) * 3 if strategy == "dsi" else 6,
                preempt=False,
                target_only_thread=False,
                target_prefill_s=target_ms / 1000,
                draft_prefill_s=draft_ms / 1000,
                link_s=link_ms / 1000,
                remote_draft=True,
                remote_servers=n,
            )
            total_s, _ = mean_result(setup, tokens, 20)
            simulated = total_s * 1000 / tokens
            name = strategy if strategy == "amusd" else f"dsi N={n}"
            print(f"{name:<10} {link_ms:>8.1f} {measured:>18.2f} {simulated:>10.2f} {measured / simulated:>6.2f}")


def part_messages(tokens: int, link_ms: float) -> None:
    """Count the channel calls the caller's ChannelServer answers (its threads run the TokenChannel methods)."""
    import collections
    import threading

    from paraspec.runtime.channels import TokenChannel
    from paraspec.runtime.net_channel import _CHANNEL_CALLS

    counts: collections.Counter = collections.Counter()
    nested = threading.local()
    for name in sorted(_CHANNEL_CALLS):
        original = getattr(TokenChannel, name)
        if not callable(original):
            continue

        def counted(self, *args, _original=original, _name=name, **kwargs):
            depth = getattr(nested, "depth", 0)  # publish_and_read calls publish_draft and read_since: one trip
            if depth == 0 and threading.current_thread().name == "paraspec-channel-conn":
                counts[_name] += 1
            nested.depth = depth + 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                nested.depth = depth

        setattr(TokenChannel, name, counted)
    print(
        f"round trips over the network transport, link {link_ms} ms, target 20 ms, draft 4 ms, a = 0.8, "
        f"lookahead 3, {tokens} tokens"
    )
    for strategy in ("amusd", "dsi"):
        with engine_for(strategy, 2, 0.02, 0.004, 0.8, 3, True, link_ms) as engine:
            engine.generate(PROMPT, SamplingParams(max_new_tokens=8))
            counts.clear()
            result = engine.generate(PROMPT, SamplingParams(max_new_tokens=tokens))
        drafts = result.worker_reports["draft"]["drafted"]
        drafter = sum(counts[name] for name in DRAFTER_CALLS)
        verifier = sum(counts.values()) - drafter
        line = f"{strategy:<6} calls {dict(counts)}; drafter {drafter / drafts:.2f} round trips per draft token"
        if strategy == "amusd":
            line += f"; verifier {verifier / result.stats.rounds:.2f} per verification"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["overhead", "latency", "messages"])
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--draft-ms", type=float, default=4.0)
    p.add_argument("--acceptance-rate", type=float, default=0.8)
    p.add_argument("--link-ms", type=float, default=0.0, help="messages: the link latency to count them at")
    args = p.parse_args()
    cluster = start_cluster(6 if args.part == "overhead" else 3)
    try:
        if args.part == "overhead":
            part_overhead(args.tokens, args.repeats)
        elif args.part == "messages":
            part_messages(args.tokens, args.link_ms)
        else:
            part_latency(args.tokens, args.repeats, args.target_ms, args.draft_ms, args.acceptance_rate)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
