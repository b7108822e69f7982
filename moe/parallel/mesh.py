"""Process groups of a (pp, dp, ep) layout, with expert parallelism folded into data parallelism.

World ranks are laid out pipeline-stage-major: rank = stage * dp + d. Within a stage the dp
data-parallel ranks form consecutive expert-parallel groups of size ep; ranks holding the
same experts (same EP index) in different EP groups form the expert-data-parallel group.

    pp=2, dp=4, ep=2:  stage 0: ranks 0 1 | 2 3    stage 1: ranks 4 5 | 6 7
                       ep groups {0,1} {2,3} {4,5} {6,7}
                       edp groups {0,2} {1,3} {4,6} {5,7}
                       pp groups {0,4} {1,5} {2,6} {3,7}
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass
class Mesh:
    pp: int
    dp: int
    ep: int
    rank: int
    # groups this rank belongs to (None when the group is just this rank)
    dp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_ranks: tuple[int, ...] = ()
    ep_ranks: tuple[int, ...] = ()
    edp_ranks: tuple[int, ...] = ()
    pp_ranks: tuple[int, ...] = ()

    @property
    def stage(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


def layout_groups(pp: int, dp: int, ep: int) -> dict[str, list[tuple[int, ...]]]:
    """Every group of each kind, as tuples of world ranks (pure; used by build_mesh and tests)."""
    groups: dict[str, list[tuple[int, ...]]] = {"dp": [], "ep": [], "edp": [], "pp": []}
    for s in range(pp):
        base = s * dp
        groups["dp"].append(tuple(range(base, base + dp)))
        for b in range(dp // ep):
            groups["ep"].append(tuple(range(base + b * ep, base + (b + 1) * ep)))
        for e in range(ep):
            groups["edp"].append(tuple(base + b * ep + e for b in range(dp // ep)))
    for d in range(dp):
        groups["pp"].append(tuple(s * dp + d for s in range(pp)))
    return groups


def build_mesh(pp: int, dp: int, ep: int) -> Mesh:
    """Create every group (a collective call: all ranks, same order) and keep this rank's."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh(pp=pp, dp=dp, ep=ep, rank=rank)
    if not dist.is_initialized():
        mesh.dp_ranks = mesh.ep_ranks = mesh.edp_ranks = mesh.pp_ranks = (0,)
        return mesh
    for kind, all_groups in layout_groups(pp, dp, ep).items():
        for ranks in all_groups:
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                setattr(mesh, f"{kind}_group", group)
                setattr(mesh, f"{kind}_ranks", ranks)
    return mesh
