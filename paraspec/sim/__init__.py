"""Speculation simulators and the planner (side modules: nothing in the decoding path imports them).

- `dsi_paper`: the DSI paper's offline model (Timor et al. 2024), reproduced: heatmaps, and Table 1's rows as data.
- `dsi_online`: the authors' thread-pool ("online") simulation that produced Table 1, replayed exactly.
- `table1`: Table 1's ten rows in the offline, online and event models.
- `events`: an event-driven simulator with explicit drafter and target servers (forward widths, catch-up,
  messages, prefill, queues) for `ar`, `sd`, `amusd` and `dsi`; emits `paraspec.trace.Trace`.
- `profile`: forward-latency models from a `paraspec profile` JSON.
- `planner`: `paraspec plan`, the fastest strategy and settings for a profile.
- `plots`: heatmap PNGs. `cli`: the `simulate` and `plan` subcommands.
"""
