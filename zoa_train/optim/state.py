"""The checkpoint state of the data-parallel optimizers (DataParallelOptimizer in base.py): what a rank
saves (the state shared by every rank, saved once, and each rank's own), loading it back at the same
world size, and continuing it at another world size or sharding (--reshard). A mixin: it reads the
optimizer's flat groups, buffers, collective, schedule and ledger, and keeps nothing of its own."""

from collections.abc import Callable

import torch

from zoa_train.comm import onebit_layout
from zoa_train.comm.onebit import TopologyChanged
from zoa_train.comm.sharding import copy_whole, sharded_like
from zoa_train.errors import UserError


class OptimizerState:
    """state_dict / load_state_dict (torch's), shared_state_dict / rank_state_dict / load_state_dicts (the
    checkpointer's, which saves the shared part once), parameter_state and load_resharded (--reshard)."""

    def state_dict(self) -> dict:
        """Everything of this rank: `shared_state_dict()` and `rank_state_dict()` together."""
        rank = self.rank_state_dict()
        return {**self.shared_state_dict(), "zoa_rank": rank["zoa_rank"]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.load_state_dicts(state_dict, state_dict)

    def shared_state_dict(self) -> dict:
        """The state that is the same on every rank (save it once): hyperparameters, schedules, the
        ledger and, when the parameters are synchronised, m, v and the anchor. A delayed round in flight
        is waited for first and saved landed, to be applied at the next step as it would have been."""
        self._wait_in_flight()
        groups, index = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(saved)
        return {
            "state": {},
            "param_groups": groups,
            "zoa": {
                "optimizer": type(self).__name__,
                "world_size": self.world_size,
                "step_count": self.step_count,
                "numels": [f.numel for f in self._flat],
                "sizes": [f.size for f in self._flat],
                "layouts": self.collective.layout_state() if self.collective is not None else None,
                "buffers": None if self.parameters_differ else self._some_buffers(shared=True),
                "scalars": self._scalars,
                "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "ledger": self.ledger.state_dict(),
                "landed_sync": self._landed,  # a delayed round's result in the buffers, applied at the next step
            },
        }

    def rank_state_dict(self) -> dict:
        """This rank's own state: the 1-bit error buffers and, inside a local-step period (when the
        ranks' momenta differ), the flat buffers too."""
        self._wait_in_flight()
        return {
            "zoa_rank": {
                "optimizer": type(self).__name__,
                "rank": self.rank,
                "world_size": self.world_size,
                "comms": self.collective.state_dicts() if self.collective is not None else [None] * len(self._flat),
                "buffers": self._buffers if self.parameters_differ else self._some_buffers(shared=False) if self._local_buffers else None,
            }
        }

    def _some_buffers(self, shared: bool) -> list[dict[str, torch.Tensor]]:
        """Each group's buffers that are the same on every rank (shared) or this rank's own."""
        return [{k: v for k, v in group.items() if (k in self._local_buffers) != shared} for group in self._buffers]

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        """Restore from a shared state (any rank's) and this rank's own state."""
        self._wait_in_flight()  # nothing may still write into the buffers
        saved, mine = shared.get("zoa"), rank.get("zoa_rank")
        name = type(self).__name__
        if saved is None or mine is None or saved["optimizer"] != name or mine["optimizer"] != name:
            raise ValueError(f"this optimizer state is not a {name} state")
        if saved["world_size"] != self.world_size or mine["world_size"] != self.world_size:
            raise ValueError(
                f"the {name} state was saved on {saved['world_size']} ranks and this run has {self.world_size}: "
                "its error buffers and local state are per rank, so resume at the same world size"
            )
        if saved["numels"] != [f.numel for f in self._flat]:
            raise ValueError(f"the {name} state is for parameter groups of sizes {saved['numels']}, not {[f.numel for f in self._flat]}")
        layouts = self.collective.layout_state() if self.collective is not None else None
        if saved.get("layouts") and layouts and saved["layouts"] != layouts:  # e.g. another comm.bucket_cap_mb
            raise TopologyChanged(
                f"the {name} state was saved in another 1-bit layout of the parameters (another comm.bucket_cap_mb or bucket order); "
                "resume with the same comm settings, or pass --reshard to continue with the error buffers at zero"
            )
        if saved.get("sizes") != [f.size for f in self._flat]:
            raise ValueError(f"the {name} state was saved with another 1-bit layout (an older zoa-train or another scale_row)")
        buffers = [{**(s or {}), **(r or {})} for s, r in zip(saved["buffers"] or [None] * len(self._flat), mine["buffers"] or [None] * len(self._flat))]
        missing = sorted({key for current, found in zip(self._buffers, buffers) for key in current if key not in found})
        if missing:
            raise ValueError(f"the {name} state holds no {', '.join(missing)} (neither shared nor per rank)")
        for group, saved_group in zip(self.param_groups, shared["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for current, saved_buffers in zip(self._buffers, buffers):
            for key, tensor in current.items():
                tensor.copy_(saved_buffers[key])
        if self.collective is not None:
            self.collective.load_state_dicts(mine["comms"])
        self._scalars = [dict(s) for s in saved["scalars"]]
        if self.schedule is not None:
            self.schedule.load_state_dict(saved["schedule"])
        self.ledger.load_state_dict(saved["ledger"])
        self.step_count = saved["step_count"]
        self._in_flight, self._landed = False, bool(saved.get("landed_sync", False))

    def parameter_state(self) -> dict[str, torch.Tensor]:
        """The flat buffers every rank holds alike at a sync (m, v, the anchor; not DiLoCo's inner
        moments) as one tensor per parameter, keyed "buffer/group.index": views of the state (writing
        them writes it), DTensors sharded as their parameters where those are. The form that does not
        depend on the layout: torch.distributed.checkpoint saves each rank's shards of it and loads them
        into another layout, sharded or not (--reshard of a sharded run)."""
        state = {}
        for g, (flat, buffers) in enumerate(zip(self._flat, self._buffers)):
            for name, buffer in buffers.items():
                if name not in self._local_buffers:
                    for i, (view, source) in enumerate(zip(flat.views(buffer), flat.sources)):
                        state[f"{name}/{g}.{i}"] = sharded_like(view, source)
        return state

    def _flat_loader(self, saved: dict) -> Callable[[dict], None]:
        """What loads `parameter_state` targets from flat buffers saved in a 1-bit layout of whole
        tensors (an unsharded run's shared state): each tensor cut out of its saved place, and this
        rank's shard of it where sharded."""
        layouts = saved.get("layouts") or [{"world_size": saved["world_size"], "padded": size} for size in saved["sizes"]]

        def load(targets: dict) -> None:
            for g, (buffers, layout) in enumerate(zip(saved["buffers"], layouts)):
                sources = self._flat[g].sources
                offsets = layout.get("offsets") or onebit_layout([p.numel() for p in sources], layout["world_size"]).offsets
                for name, flat in buffers.items():
                    for i, (offset, p) in enumerate(zip(offsets, sources)):
                        copy_whole(targets[f"{name}/{g}.{i}"], flat[offset : offset + p.numel()].view(p.shape))

        return load

    # How a reshard's message names each flat buffer.
    _buffer_words = {"exp_avg": "momentum", "exp_avg_sq": "variance", "anchor": "anchor", "outer_momentum": "outer momentum"}

    def resharded_state(self) -> str:
        """What a reshard (load_resharded) keeps and what starts at zero, in words."""
        names = list(self._buffers[0]) if self._buffers else []
        kept = [self._buffer_words.get(n, n) for n in names if n not in self._local_buffers]
        fresh = [self._buffer_words.get(n, n) for n in names if n in self._local_buffers]
        fresh += ["the 1-bit error buffers"] if self.collective is not None else []
        said = f"parameters, {', '.join(kept)} carry over" if kept else "parameters carry over"
        return said + (f"; {' and '.join(fresh)} start at zero" if fresh else "")

    def load_resharded(self, shared: dict, load_parameters: Callable[[dict], None] | None = None) -> None:
        """Continue a shared state saved at another world size or sharding (--reshard). m, v and the
        other flat buffers are identical on every rank at a synchronised step, so they carry over:
        `load_parameters` fills `parameter_state()` (a sharded run's torch.distributed.checkpoint);
        without it they come from `shared`'s flat buffers, moved by the collective from the old layout
        into its own (into this rank's shards, when sharded). This rank's own state (the 1-bit error
        buffers, DiLoCo's inner moments) starts at zero, as built. A state saved inside a local-step
        period (the ranks' buffers then differ) is refused."""
        saved, name = shared.get("zoa"), type(self).__name__
        if saved is None or saved.get("optimizer") != name:
            raise ValueError(f"this optimizer state is not a {name} state")
        if saved["buffers"] is None:
            raise UserError(
                f"cannot reshard a checkpoint taken while the ranks' parameters differ (inside a 0/1 Adam local-step period, "
                f"between DiLoCo's outer steps); resume it at its {saved['world_size']} ranks, or reshard one taken at a "
                "synchronised step (the last step of a run always is)."
            )
        whole = [sum(p.numel() for p in f.sources) for f in self._flat]
        if load_parameters is None and self.shard_group is not None and saved["numels"] == whole:
            load_parameters = self._flat_loader(saved)  # an unsharded state into shards
        if load_parameters is not None:  # checked tensor by tensor as they load
            load_parameters(self.parameter_state())
            buffers = [{k: v.clone() for k, v in group.items()} for group in self._some_buffers(shared=True)]
        elif saved["numels"] != [f.numel for f in self._flat]:
            raise ValueError(f"the {name} state is for parameter groups of sizes {saved['numels']}, not {[f.numel for f in self._flat]}")
        else:
            buffers = saved["buffers"]
        if load_parameters is None and self.collective is not None:
            layouts = saved.get("layouts") or [{"world_size": saved["world_size"], "padded": size} for size in saved["sizes"]]
            buffers = [
                {key: self.collective.relayout(flat, index, layout) for key, flat in group.items()}
                for index, (group, layout) in enumerate(zip(buffers, layouts))
            ]
        fresh = self.shared_state_dict()["zoa"]
        resharded = {
            **saved,
            "world_size": self.world_size,
            "numels": fresh["numels"],
            "sizes": fresh["sizes"],
            "layouts": fresh["layouts"],
            "buffers": buffers,
        }
        self.load_state_dicts({**shared, "zoa": resharded}, self.rank_state_dict())  # this rank's own state as built: zero errors
