"""EasySpec (Wu et al. 2025): layer-parallel drafting (the paper's "fuzzy" drafting) across devices, then bonus
calibration.

Each round (Fig. 2 of the paper; drafting and verification alternate; the round loop is tree's):
    1. bonus calibration: the draft drops every KV entry written since the last exact position and runs the
       tokens accepted last round plus the bonus token through its layers in the normal order, in one forward:
       this refills exact KV values and gives the draft distribution at the root;
    2. the draft grows a chain (tree_width 1) or a token tree with layer-parallel forwards: the layers of a group read
       one input hidden state, their attentions run in parallel -- one share per device (`draft_devices`),
       all-gathered -- and their MLPs run in order, replicated on every device;
    3. the target verifies the whole tree in one forward, and the path is accepted exactly as in `tree`.

The drafters are in drafters/layer_parallel.py (LayerParallelDrafter on one device, DeviceGroupDrafter across several).
Lossless like every strategy: the layer-parallel q is the distribution the drafts were sampled from and the one the
acceptance divides by; only acceptance, not correctness, depends on how close it is to the exact q.
With calibration off (the ablation), the accepted tokens keep their layer-parallel KV entries and the bonus token
goes through a layer-parallel forward as well.

Devices: rank 0 runs in the caller's process with the Engine's draft (and the target, which verifies with every
core of the caller while the draft ranks wait); each further draft device gets a worker holding a replica of the
draft, started at setup() in this strategy's Runtime (`self.runtime`, of the Engine's runtime kind, with its
worker_timeout watchdog), so Engine.health() sees a dead rank and close() stops them all.
"""

from __future__ import annotations

from paraspec.drafters import DraftPolicy
from paraspec.drafters.layer_parallel import DeviceGroupDrafter, LayerParallelDrafter
from paraspec.models.native.layer_parallel import layer_parallel_groups, parse_layer_groups
from paraspec.strategies.base import WITH_RAY, Capabilities, Placement, Seat
from paraspec.strategies.registry import register
from paraspec.strategies.tree import TREE_BACKENDS, TreeStrategy


@register
class EasySpec(TreeStrategy):
    name = "easyspec"
    summary = "layer-parallel drafting with bonus calibration (EasySpec)"
    option_names = TreeStrategy.option_names + ("layer_parallel_size", "layer_groups", "calibration")
    caps = Capabilities(
        backends=TREE_BACKENDS,
        runtime_kinds=WITH_RAY,  # the runtime of its draft ranks 1..
        why_not_across_nodes="its draft ranks all-gather hidden states through one shared-memory segment",
    )
    device_group = None  # DeviceGroupDrafter (several draft devices), kept across requests

    def setup(self, placement: Placement) -> None:
        super().setup(placement)
        if len(placement.draft_devices) > 1:
            self.device_group = DeviceGroupDrafter(
                self.draft_models[0],
                self.groups(),
                placement.draft_devices,
                placement.draft_checkpoints[0],
                self.open_runtime(placement),
                self.target.vocab_size,
            )

    def groups(self) -> list[list[int]]:
        """The layer groups the options ask for (they may change between requests)."""
        o, n_layers = self.options, self.draft_models[0].cfg.num_layers
        return (
            parse_layer_groups(o["layer_groups"], n_layers)
            if o["layer_groups"]
            else layer_parallel_groups(o["layer_parallel_size"], n_layers)
        )

    def round_policy(self, seat: Seat) -> DraftPolicy:
        return DraftPolicy([self.drafter()])  # one drafter, at the fixed tree shape

    def drafter(self) -> LayerParallelDrafter:
        """One draft device: every group in this process. Several: the attention layers of each group spread
        over them, one rank per device."""
        calibration = self.options["calibration"]
        if self.device_group is None:
            return LayerParallelDrafter(self.draft_models[0], self.groups(), self.target.vocab_size, calibration)
        self.device_group.set_groups(self.groups())
        self.device_group.calibration = calibration
        return self.device_group

    def close(self) -> None:
        super().close()  # the Runtime first: the ranks stop before their exchange is unlinked
        if self.device_group is not None:
            self.device_group.close()
            self.device_group = None
