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
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paraspec.sim.events import Setup, mean_result
from paraspec.sim.costs import Profile

DEFAULT_COMM_MS = 0.5        # one message between local worker processes (shared memory + a pipe wake-up)
DEFAULT_MIN_GAIN = 0.03      # speculation must predict >= 3% lower TPOT than ar: below that, model error dominates


@dataclass(frozen=True)
class Choice:
    strategy: str
    tpot_ms: float                      # predicted decode time per token (after the first)
    ms_per_token: float                 # predicted time per token including prefill
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
    choices: dict[str, Choice | None]   # best setting per strategy; None when the devices do not allow it
    recommended: Choice
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"recommended": asdict(self.recommended),
                "strategies": {k: (asdict(v) if v else None) for k, v in self.choices.items()},
                "notes": list(self.notes)}

    def render(self) -> str:
        p = self.profile
        ar = self.choices["ar"].tpot_ms
        lines = [f"target {p.target.model} on {p.target.device or '?'}: {p.target.tpot_ms:.1f} ms/token; "
                 f"draft {p.draft.model} on {p.draft.device or '?'}: {p.draft.tpot_ms:.1f} ms/token "
                 f"(c = {p.draft.tpot_ms / p.target.tpot_ms:.3f}); acceptance rate {p.acceptance_rate:.2f}; "
                 f"devices {' '.join(p.devices)}",
                 "",
                 f"{'strategy':<9} {'settings':<34} {'TPOT ms':>9} {'vs ar':>7}  placement"]
        for name, choice in self.choices.items():
            if choice is None:
                lines.append(f"{name:<9} {'(needs two devices)':<34}")
                continue
            lines.append(f"{name:<9} {choice.settings():<34} {choice.tpot_ms:>9.1f} {ar / choice.tpot_ms:>6.2f}x  "
                         f"{choice.placement()}")
        r = self.recommended
        lines += ["", f"recommended: {r.strategy} ({r.settings()}; {r.placement()}): "
                      f"{r.tpot_ms:.1f} ms/token, {ar / r.tpot_ms:.2f}x ar"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan(profile: Profile, tokens: int = 128, repeats: int = 3, lookaheads=range(1, 11),
         comm_ms: float = DEFAULT_COMM_MS, min_gain: float = DEFAULT_MIN_GAIN, seed: int = 0) -> Plan:
    if tokens < 2:
        raise ValueError(f"tokens={tokens}: simulate at least 2 tokens (TPOT is measured after the first)")
    if comm_ms < 0:
        raise ValueError(f"comm_ms={comm_ms} must be >= 0")
    lookaheads = list(lookaheads)
    if not lookaheads or min(lookaheads) < 1:
        raise ValueError(f"lookaheads {lookaheads} must be integers >= 1")
    devices = list(profile.devices)
    target_dev = profile.target.device or devices[-1]
    draft_dev = profile.draft.device or (devices[0] if devices[0] != target_dev else devices[-1])
    target, draft = profile.target.cost(), profile.draft.cost()
    # paraspec's draft workers finish a forward in flight before they hear of a rollback: no preemption
    base = dict(target=target, draft=draft, acceptance_rate=profile.acceptance_rate, preempt=False,
                target_prefill_s=profile.target.ttft_ms / 1000, draft_prefill_s=profile.draft.ttft_ms / 1000)

    def run(strategy: str, **kw) -> tuple[float, float]:
        total_s, tpot_ms = mean_result(Setup(strategy, **{**base, **kw}), tokens, repeats, seed)
        return tpot_ms, 1000 * total_s / tokens

    tpot, mpt = run("ar", draft=None)
    choices: dict[str, Choice | None] = {"ar": Choice("ar", tpot, mpt, None, (target_dev,))}

    # sd alternates draft and target, so it gains nothing from two devices; co-located it pays no messages
    sd_comm = 0.0 if draft_dev == target_dev else comm_ms / 1000
    choices["sd"] = min((Choice("sd", *run("sd", lookahead=k, comm_s=sd_comm), draft_dev, (target_dev,), lookahead=k)
                         for k in lookaheads), key=lambda c: c.tpot_ms)

    others = [d for d in devices if d != draft_dev]
    if draft_dev == target_dev or not others:
        choices["amusd"] = choices["dsi"] = None
    else:
        choices["amusd"] = min((Choice("amusd", *run("amusd", max_ahead=m, verify_min=v, comm_s=comm_ms / 1000),
                                       draft_dev, (target_dev,), max_ahead=m, verify_min=v)
                                for m in lookaheads for v in sorted({1, m})), key=lambda c: c.tpot_ms)
        servers_order = [target_dev] + [d for d in others if d != target_dev]
        choices["dsi"] = min((Choice("dsi", *run("dsi", lookahead=k, servers=n, comm_s=comm_ms / 1000),
                                     draft_dev, tuple(servers_order[:n]), lookahead=k, servers=n)
                              for k in lookaheads for n in range(1, len(servers_order) + 1)),
                             key=lambda c: c.tpot_ms)

    ar = choices["ar"]
    notes = []
    if choices["sd"].tpot_ms > ar.tpot_ms:
        notes.append(f"sd is slower than ar ({choices['sd'].tpot_ms:.1f} vs {ar.tpot_ms:.1f} ms/token): the draft is "
                     f"too slow or too inaccurate for synchronous speculation to pay")
    fastest = min((c for c in choices.values() if c is not None), key=lambda c: c.tpot_ms)
    if fastest.strategy != "ar" and fastest.tpot_ms > ar.tpot_ms * (1 - min_gain):
        notes.append(f"speculation does not pay here: the best, {fastest.strategy}, predicts {fastest.tpot_ms:.1f} "
                     f"ms/token, less than {min_gain:.0%} below ar; run ar")
        fastest = ar
    elif fastest.strategy == "ar":
        notes.append("speculation does not pay here: no strategy beats ar; run ar")
    if choices["dsi"] is None:
        notes.append("amusd and dsi need the draft and the target on different devices; pass more devices")
    notes.append(f"assumes {comm_ms:g} ms per message, every target server as fast as {target_dev}, "
                 f"draft tokens accepted independently at rate {profile.acceptance_rate:.2f}, "
                 f"and a draft forward in flight at a rollback run to its end (as the draft workers do)")
    return Plan(profile, choices, fastest, notes)
