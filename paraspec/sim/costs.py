"""Forward latencies for the simulators: a cost model per model, built from a measured profile or a line.

The profile is the JSON that `paraspec profile` writes (all times in milliseconds):

    {"target": {"model": "...", "device": "cpu:1", "ttft_ms": 900.0, "tpot_ms": 376.0,
                "forward_ms": {"1": 376.0, "4": 390.0, "8": 410.0}},
     "draft":  {"model": "...", "device": "cpu:0", "ttft_ms": 300.0, "tpot_ms": 133.0, "forward_ms": {"1": 133.0}},
     "acceptance_rate": 0.8, "mean_match_length": 4.0, "devices": ["cpu:0", "cpu:1"]}

`forward_ms` (optional) is the time of one forward of n new tokens with a warm cache. Verifying k drafts, or a
DSI server catching up on tokens it has not seen, is such a forward, so its width matters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Extra cost of each additional token in a forward, as a fraction of a 1-token forward, when only the
# 1-token time is known: (c(8) / c(1) - 1) / 7 of a small draft model's forward on one core
# (`benchmarks/bench_forward_widths.py --widths 1,8 --dtype bfloat16` prints c(n)).
DEFAULT_PER_TOKEN_FRACTION = 0.02


@dataclass(frozen=True)
class ForwardCost:
    """Seconds for one forward of n new tokens: piecewise-linear through measured points, extended past the
    widest point with the slope of the last two (or `per_token_fraction` of the 1-token time when only one
    point is known)."""

    widths: tuple[int, ...]
    seconds: tuple[float, ...]
    per_token_fraction: float = DEFAULT_PER_TOKEN_FRACTION

    def __post_init__(self):
        if not self.widths or len(self.widths) != len(self.seconds):
            raise ValueError("a forward cost needs at least one (tokens, seconds) point")
        if list(self.widths) != sorted(set(self.widths)) or self.widths[0] < 1:
            raise ValueError(f"forward widths must be distinct positive token counts, got {self.widths}")
        if min(self.seconds) <= 0:
            raise ValueError(f"forward times must be positive, got {self.seconds}")

    @classmethod
    def constant(cls, seconds: float) -> ForwardCost:
        """The paper's assumption: a forward costs the same whatever its width."""
        return cls((1,), (float(seconds),), per_token_fraction=0.0)

    @classmethod
    def linear(cls, one_token_s: float, per_token_fraction: float = DEFAULT_PER_TOKEN_FRACTION) -> ForwardCost:
        return cls((1,), (float(one_token_s),), per_token_fraction)

    @classmethod
    def from_ms(
        cls, tpot_ms: float, forward_ms: dict | None = None, per_token_fraction: float = DEFAULT_PER_TOKEN_FRACTION
    ) -> ForwardCost:
        points = {int(n): float(ms) / 1000 for n, ms in (forward_ms or {}).items()}
        points.setdefault(1, float(tpot_ms) / 1000)  # tpot is the 1-token forward when not measured
        widths = tuple(sorted(points))
        return cls(widths, tuple(points[n] for n in widths), per_token_fraction)

    def __call__(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"a forward processes at least one token, got {n}")
        w, s = self.widths, self.seconds
        if n >= w[-1]:
            slope = (s[-1] - s[-2]) / (w[-1] - w[-2]) if len(w) > 1 else s[0] * self.per_token_fraction
            return s[-1] + max(slope, 0.0) * (n - w[-1])
        for i in range(len(w) - 1):  # few points: a scan reads clearer than bisect
            if w[i] <= n <= w[i + 1]:
                return s[i] + (s[i + 1] - s[i]) * (n - w[i]) / (w[i + 1] - w[i])
        return s[0]  # below the narrowest point (only when w[0] > 1)


@dataclass(frozen=True)
class ModelProfile:
    model: str
    device: str
    tpot_ms: float
    ttft_ms: float = 0.0
    forward_ms: dict = field(default_factory=dict)

    def cost(self, per_token_fraction: float = DEFAULT_PER_TOKEN_FRACTION) -> ForwardCost:
        return ForwardCost.from_ms(self.tpot_ms, self.forward_ms, per_token_fraction)


@dataclass(frozen=True)
class Profile:
    target: ModelProfile
    draft: ModelProfile
    acceptance_rate: float
    devices: tuple[str, ...]
    mean_match_length: float | None = None

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> Profile:
        def need(obj: dict, key: str, where: str, hint: str):
            if not isinstance(obj, dict) or key not in obj or obj[key] is None:
                raise ValueError(f"{source} is missing {where}{key} ({hint}); run `paraspec profile` again or add it")
            return obj[key]

        def model(role: str) -> ModelProfile:
            m = need(d, role, "", f"the {role} model's timings")
            tpot = float(need(m, "tpot_ms", f"{role}.", "milliseconds per generated token"))
            if tpot <= 0:
                raise ValueError(f"{source}: {role}.tpot_ms={tpot} must be positive")
            forward = {str(n): float(ms) for n, ms in (m.get("forward_ms") or {}).items()}
            for n in forward:
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f'{source}: {role}.forward_ms key {n!r} must be a token count like "8"')
            return ModelProfile(
                model=str(m.get("model", role)),
                device=str(m.get("device", "")),
                tpot_ms=tpot,
                ttft_ms=float(m.get("ttft_ms") or 0.0),
                forward_ms=forward,
            )

        target, draft = model("target"), model("draft")
        a = float(need(d, "acceptance_rate", "", "fraction of drafted tokens the target accepted"))
        if not 0 <= a < 1:
            raise ValueError(f"{source}: acceptance_rate={a} must be in [0, 1) (a fraction, e.g. 0.8 for 80%)")
        devices = d.get("devices") or [x for x in (draft.device, target.device) if x]
        if not devices:
            raise ValueError(f'{source} is missing devices (the devices available, e.g. ["cpu:0", "cpu:1"])')
        mml = d.get("mean_match_length")
        return cls(target, draft, a, tuple(dict.fromkeys(str(x) for x in devices)), None if mml is None else float(mml))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(
                f"cannot read profile {path}: {e.strerror}; pass the JSON written by `paraspec profile`"
            ) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"profile {path} is not valid JSON ({e.msg} at line {e.lineno}); "
                f"pass the file written by `paraspec profile`"
            ) from None
        return cls.from_dict(d, source=f"profile {path}")
