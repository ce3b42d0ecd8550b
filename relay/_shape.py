"""Named-dimension mesh views: extents, points and slicing (row-major, like Monarch)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Point:
    """A position in a mesh: ``rank`` (row-major index in the mesh) and named ``coords``."""

    rank: int
    coords: dict[str, int]
    extent: dict[str, int]

    def __getitem__(self, dim: str) -> int:
        return self.coords[dim]


class View:
    """Dims (ordered names -> sizes) over a list of members, addressed row-major."""

    __slots__ = ("dims", "members")

    def __init__(self, dims: dict[str, int], members: list[Any]):
        n = 1
        for name, size in dims.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dim {name!r} must be a positive int, got {size!r}")
            n *= size
        if n != len(members):
            raise ValueError(f"mesh dims {dims} hold {n} members, got {len(members)}")
        self.dims = dict(dims)
        self.members = list(members)

    def __len__(self) -> int:
        return len(self.members)

    def points(self) -> list[Point]:
        names = list(self.dims)
        ranges = [range(s) for s in self.dims.values()]
        return [
            Point(rank, dict(zip(names, c)), self.dims)
            for rank, c in enumerate(itertools.product(*ranges))
        ]

    def slice(self, **sel: int | slice) -> View:
        """Select by dim: an int drops the dim, a ``slice`` keeps it (as in Monarch)."""
        for name in sel:
            if name not in self.dims:
                raise ValueError(f"no dim {name!r} in mesh with dims {list(self.dims)}")
        keep: dict[str, range] = {}
        fixed: dict[str, int] = {}
        for name, size in self.dims.items():
            s = sel.get(name)
            if s is None:
                keep[name] = range(size)
            elif isinstance(s, slice):
                r = range(size)[s]
                if len(r) == 0:
                    raise ValueError(f"slice {s} of dim {name!r} (size {size}) is empty")
                keep[name] = r
            elif isinstance(s, int):
                if not -size <= s < size:
                    raise IndexError(f"index {s} out of range for dim {name!r} of size {size}")
                fixed[name] = s % size
            else:
                raise TypeError(f"slice dim {name!r} with an int or a slice, not {type(s).__name__}")
        names = list(self.dims)
        sizes = list(self.dims.values())
        members = []
        for combo in itertools.product(*keep.values()):
            coords = dict(zip(keep, combo), **fixed)
            idx = 0
            for name, size in zip(names, sizes):
                idx = idx * size + coords[name]
            members.append(self.members[idx])
        return View({k: len(r) for k, r in keep.items()}, members)
