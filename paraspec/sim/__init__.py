"""Speculation simulators and the planner (side modules; the decoding path imports only `costs`, the latencies
of the simulated models in models/simulated.py).

- `dsi_paper`: the DSI paper's offline model (Timor et al. 2024), reproduced: heatmaps, and Table 1's rows as data.
- `dsi_online`: the authors' thread-pool ("online") simulation that produced Table 1, replayed exactly.
- `table1`: Table 1's ten rows in the offline, online and event models.
- `events`: an event-driven simulator with explicit drafter and target servers (forward widths, catch-up,
  messages, prefill, queues) for `ar`, `sd`, `amusd` and `dsi`; emits `paraspec.trace.Trace`.
- `costs`: forward-latency models from a `paraspec profile` JSON (the simulated models use them too).
- `planner`: `paraspec plan`, the fastest strategy and settings for a profile.
- `plots`: heatmap PNGs. The `simulate` and `plan` commands are in paraspec/cli/simulate.py.
"""
