"""`paraspec plan`: which strategy, lookahead, servers and placement to run, predicted with the event simulator.

Input: a `Profile` (target and draft forward times, acceptance rate, the devices available). Every strategy is
simulated over its settings (lookahead, servers, how far AMUSD's drafter may run ahead) with the measured
forward widths, prefill and a per-message latency; the fastest setting of each is kept and the fastest strategy
is recommended. Speculation has to beat `ar` by `min_gain` to be recommended: when it does not (synchronous
speculation slower than the target alone is the paper's motivating case, Timor et al. 2024, Fig. 1), the plan
says so and picks `ar`.

Assumptions (printed with the plan): every target server runs at the profiled target device's speed, each
device holds one model, each draft is accepted with the profiled rate independently of the others, and a rollback
lets the drafter's forward in flight finish (the workers cannot cut a forward short).

Devices on other nodes: a device written `NODE/cpu:0` is on another node than the caller (a device without a
node is on the caller's); every message a worker there sends or receives also pays `link_ms`. DSI's servers are
taken on the caller's node first; when remote devices are available, the plan also says up to which link latency
a remote target server still pays (`remote_break_even_ms`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from paraspec.sim.costs import Profile
from paraspec.sim.events import Setup, mean_result

# run(strategy, **setup) -> (TPOT ms, ms per token incl. prefill): _simulator's
Simulate = Callable[..., tuple[float, float]]

DEFAULT_COMM_MS = 0.5  # one message between local worker processes (shared memory + a pipe wake-up)
DEFAULT_MIN_GAIN = 0.03  # speculation must predict >= 3% lower TPOT than ar: below that, model error dominates
DEFAULT_LINK_MS = 1.0  # one message to another node (a LAN round trip is two)
LINK_GRID_MS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


def is_remote(device: str | None) -> bool:
    """A device on another node than the caller's (written NODE/...)."""
    return device is not None and "/" in device


@dataclass(frozen=True)
class Choice:
    strategy: str
    tpot_ms: float  # predicted decode time per token (after the first)
    ms_per_token: float  # predicted time per token including prefill
    draft_device: str | None
    target_devices: tuple[str, ...]
    lookahead: int | None = None
    servers: int = 1
    max_ahead: int | None = None
    verify_min: int | None = None

    def settings(self) -> str:
        if self.strategy == "ar":
            return "-"
        if self.strategy == "sd":
            return f"lookahead {self.lookahead}"
        if self.strategy == "amusd":
            return f"max_ahead {self.max_ahead}, verify_min {self.verify_min}"
        return f"lookahead {self.lookahead}, {self.servers} target server{'s' * (self.servers > 1)}"

    def placement(self) -> str:
        targets = ", ".join(self.target_devices)
        if self.draft_device is None:
            return f"target {targets}"
        return f"draft {self.draft_device}, target{'s' * (len(self.target_devices) > 1)} {targets}"


@dataclass
class Plan:
    profile: Profile
    choices: dict[str, Choice | None]  # best setting per strategy; None when the devices do not allow it
    recommended: Choice
    notes: list[str] = field(default_factory=list)
    remote_break_even_ms: float | None = None  # dsi: the largest link latency at which its remote servers still
    # beat dsi on the caller's node alone (None: no remote device)

    def to_dict(self) -> dict:
        return {
            "recommended": asdict(self.recommended),
            "strategies": {k: (asdict(v) if v else None) for k, v in self.choices.items()},
            "remote_break_even_ms": self.remote_break_even_ms,
            "notes": list(self.notes),
        }

    def render(self) -> str:
        p = self.profile
        ar_choice = self.choices["ar"]
        assert ar_choice is not None  # ar and sd are always simulated; only amusd and dsi may be None
        ar = ar_choice.tpot_ms
        lines = [
            f"target {p.target.model} on {p.target.device or '?'}: {p.target.tpot_ms:.1f} ms/token; "
            f"draft {p.draft.model} on {p.draft.device or '?'}: {p.draft.tpot_ms:.1f} ms/token "
            f"(c = {p.draft.tpot_ms / p.target.tpot_ms:.3f}); acceptance rate {p.acceptance_rate:.2f}; "
            f"devices {' '.join(p.devices)}",
            "",
            f"{'strategy':<9} {'settings':<34} {'TPOT ms':>9} {'vs ar':>7}  placement",
        ]
        for name, choice in self.choices.items():
            if choice is None:
                lines.append(f"{name:<9} {'(needs two devices)':<34}")
                continue
            lines.append(
                f"{name:<9} {choice.settings():<34} {choice.tpot_ms:>9.1f} {ar / choice.tpot_ms:>6.2f}x  "
                f"{choice.placement()}"
            )
        r = self.recommended
        lines += [
            "",
            f"recommended: {r.strategy} ({r.settings()}; {r.placement()}): "
            f"{r.tpot_ms:.1f} ms/token, {ar / r.tpot_ms:.2f}x ar",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fastest(choices) -> Choice:
    """The choice with the lowest predicted TPOT (the first of equals)."""
    return min(choices, key=lambda c: c.tpot_ms)


def _checked_lookaheads(tokens: int, comm_ms: float, link_ms: float, lookaheads) -> list[int]:
    """Reject arguments the simulation cannot answer, at the boundary; the lookaheads as a list."""
    if tokens < 2:
        raise ValueError(f"tokens={tokens}: simulate at least 2 tokens (TPOT is measured after the first)")
    if comm_ms < 0 or link_ms < 0:
        raise ValueError(f"comm_ms={comm_ms} and link_ms={link_ms} must be >= 0")
    lookaheads = list(lookaheads)
    if not lookaheads or min(lookaheads) < 1:
        raise ValueError(f"lookaheads {lookaheads} must be integers >= 1")
    return lookaheads


def _simulator(profile: Profile, tokens: int, repeats: int, seed: int, link_ms: float) -> Simulate:
    """run(strategy, **setup) -> (TPOT ms, ms per token incl. prefill): one simulated setting, the profile's
    costs filled in, so every strategy is predicted under the same assumptions."""
    target, draft = profile.target.cost(), profile.draft.cost()
    # paraspec's draft workers finish a forward in flight before they hear of a rollback: no preemption
    base = dict(
        target=target,
        draft=draft,
        acceptance_rate=profile.acceptance_rate,
        preempt=False,
        target_prefill_s=profile.target.ttft_ms / 1000,
        draft_prefill_s=profile.draft.ttft_ms / 1000,
        link_s=link_ms / 1000,
    )

    def run(strategy: str, **kw) -> tuple[float, float]:
        total_s, tpot_ms = mean_result(Setup(strategy, **{**base, **kw}), tokens, repeats, seed)
        return tpot_ms, 1000 * total_s / tokens

    return run


def _best_sd(
    run: Simulate, lookaheads: list[int], draft_dev: str, target_dev: str, comm_ms: float, link_ms: float
) -> Choice:
    """sd alternates draft and target, so it gains nothing from two devices; co-located it pays no messages."""
    sd_comm = 0.0 if draft_dev == target_dev else comm_ms / 1000 + (link_ms / 1000 if is_remote(target_dev) else 0)
    return _fastest(
        Choice("sd", *run("sd", lookahead=k, comm_s=sd_comm), draft_dev, (target_dev,), lookahead=k) for k in lookaheads
    )


def _best_amusd(run: Simulate, lookaheads: list[int], draft_dev: str, target_dev: str, comm_ms: float) -> Choice:
    """AMUSD's drafter may run `max_ahead` tokens ahead; verifying from 1 or only at max_ahead bracket the choice."""
    return _fastest(
        Choice(
            "amusd",
            *run("amusd", max_ahead=m, verify_min=v, comm_s=comm_ms / 1000, remote_servers=int(is_remote(target_dev))),
            draft_dev,
            (target_dev,),
            max_ahead=m,
            verify_min=v,
        )
        for m in lookaheads
        for v in sorted({1, m})
    )


def _dsi_simulator(run: Simulate, servers_order: list[str], draft_dev: str, comm_ms: float):
    """dsi(k, n, **setup) -> Choice for lookahead k on the first n servers; the remote servers are the last ones,
    as in the simulator, so n counts the caller's node's servers first."""

    def dsi(k: int, n: int, **kw) -> Choice:
        remote = sum(map(is_remote, servers_order[:n]))
        return Choice(
            "dsi",
            *run("dsi", lookahead=k, servers=n, comm_s=comm_ms / 1000, remote_servers=remote, **kw),
            draft_dev,
            tuple(servers_order[:n]),
            lookahead=k,
            servers=n,
        )

    return dsi


def _recommendation(choices: dict[str, Choice | None], min_gain: float) -> tuple[Choice, list[str]]:
    """The fastest choice, but ar unless speculation beats it by `min_gain` (below that the simulator's model error
    is larger than the gain), and the notes that say why."""
    ar, sd = choices["ar"], choices["sd"]
    assert ar is not None and sd is not None  # always simulated; only amusd and dsi may be None
    notes = []
    if sd.tpot_ms > ar.tpot_ms:
        notes.append(
            f"sd is slower than ar ({sd.tpot_ms:.1f} vs {ar.tpot_ms:.1f} ms/token): the draft is "
            f"too slow or too inaccurate for synchronous speculation to pay"
        )
    fastest = _fastest(c for c in choices.values() if c is not None)
    if fastest.strategy != "ar" and fastest.tpot_ms > ar.tpot_ms * (1 - min_gain):
        notes.append(
            f"speculation does not pay here: the best, {fastest.strategy}, predicts {fastest.tpot_ms:.1f} "
            f"ms/token, less than {min_gain:.0%} below ar; run ar"
        )
        fastest = ar
    elif fastest.strategy == "ar":
        notes.append("speculation does not pay here: no strategy beats ar; run ar")
    if choices["dsi"] is None:
        notes.append("amusd and dsi need the draft and the target on different devices; pass more devices")
    return fastest, notes


def _remote_servers_verdict(
    dsi, lookaheads: list[int], servers_order: list[str], link_ms: float
) -> tuple[float | None, list[str]]:
    """(remote_break_even_ms, notes) for dsi's remote target servers; (None, []) when every server is local."""
    local_servers = sum(not is_remote(d) for d in servers_order)
    if local_servers == len(servers_order):
        return None, []
    break_even = remote_break_even(dsi, lookaheads, local_servers, len(servers_order))
    if local_servers == 0:
        note = "every target device is on another node: dsi pays the link on every verification"
    elif break_even is None:
        note = (
            f"remote target servers do not pay even over a free link: dsi on the caller's node "
            f"({local_servers} server{'s' * (local_servers > 1)}) is as fast"
        )
    else:
        note = (
            f"remote target servers pay while a message to their node takes up to ~{break_even:g} ms "
            f"(planned at {link_ms:g} ms); above that run dsi on the caller's node alone"
        )
    return break_even, [note]


def plan(
    profile: Profile,
    tokens: int = 128,
    repeats: int = 3,
    lookaheads=range(1, 11),
    comm_ms: float = DEFAULT_COMM_MS,
    min_gain: float = DEFAULT_MIN_GAIN,
    seed: int = 0,
    link_ms: float = DEFAULT_LINK_MS,
) -> Plan:
    """Simulate every strategy over its settings on `profile` and recommend the fastest (see the module docstring).

    The drafter goes on the first device and the target on the last unless the profile places them; amusd and dsi
    need them apart, and dsi's extra servers are the remaining devices."""
    lookaheads = _checked_lookaheads(tokens, comm_ms, link_ms, lookaheads)
    devices = list(profile.devices)
    target_dev = profile.target.device or devices[-1]
    draft_dev = profile.draft.device or (devices[0] if devices[0] != target_dev else devices[-1])
    run = _simulator(profile, tokens, repeats, seed, link_ms)
    if is_remote(draft_dev):
        raise ValueError(
            f"the draft device {draft_dev} is on another node: the planner places the drafter on the "
            f"caller's node; list a device without a node first"
        )

    choices: dict[str, Choice | None] = {"ar": Choice("ar", *run("ar", draft=None), None, (target_dev,))}
    choices["sd"] = _best_sd(run, lookaheads, draft_dev, target_dev, comm_ms, link_ms)
    others = [d for d in devices if d != draft_dev]
    if draft_dev == target_dev or not others:
        choices["amusd"] = choices["dsi"] = None
    else:
        choices["amusd"] = _best_amusd(run, lookaheads, draft_dev, target_dev, comm_ms)
        # servers on the caller's node first, then the remote ones (in the simulator, the last servers)
        servers_order = sorted([target_dev] + [d for d in others if d != target_dev], key=is_remote)
        dsi = _dsi_simulator(run, servers_order, draft_dev, comm_ms)
        choices["dsi"] = _fastest(dsi(k, n) for k in lookaheads for n in range(1, len(servers_order) + 1))

    fastest, notes = _recommendation(choices, min_gain)
    break_even = None
    if choices["dsi"] is not None:
        break_even, remote_notes = _remote_servers_verdict(dsi, lookaheads, servers_order, link_ms)
        notes += remote_notes
    notes.append(
        f"assumes {comm_ms:g} ms per message, {link_ms:g} ms more across nodes, every target server as "
        f"fast as {target_dev}, "
        f"draft tokens accepted independently at rate {profile.acceptance_rate:.2f}, "
        f"and a draft forward in flight at a rollback run to its end (as the draft workers do)"
    )
    return Plan(profile, choices, fastest, notes, break_even)


def remote_break_even(dsi, lookaheads, local_servers: int, all_servers: int) -> float | None:
    """The largest link latency (ms, on LINK_GRID_MS) at which dsi with the remote servers is still faster than
    dsi with the caller's node's servers alone; None if it is not faster even at 0 ms."""
    if local_servers == 0:
        return None
    local = _fastest(dsi(k, n) for k in lookaheads for n in range(1, local_servers + 1))
    best = None
    for link_ms in LINK_GRID_MS:
        remote = _fastest(
            dsi(k, n, link_s=link_ms / 1000) for k in lookaheads for n in range(local_servers + 1, all_servers + 1)
        )
        if remote.tpot_ms >= local.tpot_ms:
            break
        best = link_ms
    return best
