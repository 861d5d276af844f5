"""SDP's masking modes as objects: one per `masking.name` that trains subnetworks, in `MODES`.

A mode holds what differs between backward and forward masking, which the rest of `sdp.subnet`
and the planner ask it instead of comparing its name: how a full model becomes this rank's
subnetwork (`install`), the refusals its mask adds (`check`), the parameters a forward pass runs
(`forward_params`), how the plain model comes back from the subnetworks (the `Assembler`'s
`full_parameters`, `current_plain_model`, `eval_model` and `plain_state_dict` call the mode's),
whether `masking.scale` applies (`scaled`) and SDP x FSDP hosts it (`shards`), and how the planner
captions it and words its quality (`caption`, `caveat`). The planner weighs every registered mode.
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.errors import ConfigError
from sdp.parallel import move_to
from sdp.subnet import coverage_key, resolved_scale
from sdp.subnet.apply import apply_backward_masking, apply_forward_masking


class MaskingMode:
    """The base of a masking mode (see the module docstring); `name` is its `masking.name`."""

    name = ""
    group = ""  # the config group (conf/masking/GROUP.yaml) whose keys it takes; "": its name
    caption = ""  # the planner's plot legend
    scaled = False  # masking.scale applies (the subnetwork's activations are rescaled)
    shards = False  # SDP x FSDP can host it (a worker's subnetwork is a model of its own)
    runs_subnetwork = False  # a forward pass runs the subnetwork alone (the layered estimate's block line)

    def install(self, model: nn.Module, plan, mask, *, worker: int, device: torch.device, outer: bool):
        """`model` (a full plain model, current weights) as worker `worker`'s subnetwork under `mask`
        (`plan`: the run's SubnetPlan): (Subnet, chunks)."""
        raise NotImplementedError

    def check(self, plan) -> None:
        """The refusals of `plan`'s mask this mode adds (ConfigError)."""

    def forward_params(self, strategy) -> int:
        """The parameters one forward pass of `strategy` (an SDPStrategy) runs."""
        raise NotImplementedError

    def full_parameters(self, assembler, installed) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def current_plain_model(self, assembler, installed, *, counted: bool) -> nn.Module:
        raise NotImplementedError

    def eval_model(self, assembler, installed) -> nn.Module:
        raise NotImplementedError

    def plain_state_dict(self, assembler, installed, eval_model: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def caveat(self, *, flop_matched: bool) -> str:
        """The replica reports' word on this mode's quality (claim numbers of results/cpu_replica/claims.md)."""
        return ""


class Backward(MaskingMode):
    """Backward masking: every rank runs the full forward; its held ranges are views into the full
    weights, the only ones its backward and optimizer step touch."""

    name, caption = "backward", "SDP backward"

    def install(self, model, plan, mask, *, worker, device, outer):
        # Pieces view the full weights: they must be made where the weights live.
        return apply_backward_masking(move_to(model, device), plan.spec, mask, rank=worker)

    def forward_params(self, strategy) -> int:
        return strategy.full_params  # the full model's forward, on every rank

    @torch.no_grad()
    def full_parameters(self, assembler, installed):
        out = {}
        for name in assembler.plan.shapes:
            owner_path, _, attr = name.rpartition(".")
            owner = installed.model.get_submodule(owner_path) if owner_path else installed.model
            out[name] = owner._buffers.get(f"{attr}_full", getattr(owner, attr))
        return out

    @torch.no_grad()
    def current_plain_model(self, assembler, installed, *, counted):
        assembler.sync_buffers(installed, comm=assembler.comm if counted else None, kind="resample")
        full = assembler.fresh_plain()
        params = self.full_parameters(assembler, installed)  # current everywhere: the refresh ran after the step
        for name, p in full.named_parameters():
            p.copy_(params[name])
        buffers = dict(installed.model.named_buffers())
        for name, b in full.named_buffers():
            b.copy_(buffers[name])
        return full

    def eval_model(self, assembler, installed):
        assembler.sync_buffers(installed, comm=None, kind="eval")
        return installed.model

    def plain_state_dict(self, assembler, installed, eval_model):
        # Backward masking evaluates its own model: drop the held-range views and put the full
        # weights back under their plain names.
        state = {k: v for k, v in eval_model.state_dict().items() if "_held_ranges." not in k}
        return {**state, **self.full_parameters(assembler, installed)}

    def caveat(self, *, flop_matched: bool) -> str:
        if flop_matched:
            return "1/C the steps: beat DDP (1)"
        return "trails DDP at its step count, less than forward (4b, 5)"


class Forward(MaskingMode):
    """Forward masking: each worker's subnetwork is a smaller model of its own; the full model is
    assembled from the holders for evaluation and export."""

    name, caption = "forward", "SDP forward"
    scaled = shards = runs_subnetwork = True

    def install(self, model, plan, mask, *, worker, device, outer):
        # Slice where the full model is, then move only the submodel: when it is on the host, the
        # device never holds the full model.
        scale = resolved_scale(plan.cfg)
        subnet, chunks = apply_forward_masking(model, plan.spec, mask, rank=worker, scale=scale, outer=outer)
        move_to(subnet.model, device)
        return subnet, chunks

    def check(self, plan) -> None:
        """A worker must hold a unit of every neuron group (its subnetwork would have no path
        through that site): refused."""
        k = plan.workers
        for g, group in enumerate(plan.spec.groups):
            for worker in range(k):
                if group.kind != "block" and plan.mask.held_units(worker, g).size == 0:
                    key, value = coverage_key(plan.cfg, worker)
                    raise ConfigError(
                        key,
                        value,
                        f"leaves worker {worker} of {k} no unit of {group.name} ({group.num_units} {group.kind} "
                        f"units); raise {'its capacity' if plan.cfg.capacity else 'the coverage'}, use fewer "
                        "workers or masking.granularity=block",
                    )

    def forward_params(self, strategy) -> int:
        return sum(p.numel() for p in strategy.model.parameters())  # the smaller subnetwork (DTensors: unsharded)

    def full_parameters(self, assembler, installed):
        return dict(assembler.assemble(installed, fold_eval_scale=False).named_parameters())

    def current_plain_model(self, assembler, installed, *, counted):
        return assembler.assemble(installed, fold_eval_scale=False, comm_kind="resample" if counted else None)

    def eval_model(self, assembler, installed):
        return assembler.assemble(installed, fold_eval_scale=True)

    def plain_state_dict(self, assembler, installed, eval_model):
        return eval_model.state_dict()  # the assembled plain model

    def caveat(self, *, flop_matched: bool) -> str:
        return "1/C the steps: trailed DDP (1)" if flop_matched else "trails DDP at its step count (4b, 5)"


MODES: dict[str, MaskingMode] = {}


def register(mode: MaskingMode) -> MaskingMode:
    """Add `mode` under its `masking.name` (a second one of the same name is refused)."""
    if mode.name in MODES or not mode.name:
        raise ValueError(f"a masking mode named {mode.name!r} is registered already or not allowed")
    MODES[mode.name] = mode
    return mode


def mode_of(name) -> MaskingMode:
    """The mode of an SDP `masking.name`."""
    return MODES[str(name)]


def masking_overrides(name: str) -> list[str]:
    """The command-line overrides that select `masking.name=name`: its config group, and its
    name where the mode takes another mode's group."""
    if name not in MODES:
        return [f"masking={name}"]
    group = MODES[name].group or name
    return [f"masking={group}", *([f"masking.name={name}"] if group != name else [])]


register(Backward())
register(Forward())
