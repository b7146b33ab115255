"""A picture of the KV block pool over a run (``pagedpack generate --kv-plot FILE.png``).

:class:`KVTimeline` records the pool after every engine step (blocks in use, cached but free,
free; which request holds which block); :func:`draw_kv_timeline` draws it with matplotlib: the
three counts per step on top, and below the block table of one step laid out as a grid of
blocks coloured by the request holding them (shared blocks, held by several requests, in one
colour of their own). Needs ``matplotlib`` (``pip install "pagedpack[plot]"``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedpack.formats.files import atomic_write

FIGURE_SIZE = (10.0, 7.0)  # inches
DPI = 100  # so the PNG is 1000 x 700 pixels
_GRID_COLUMNS = 32
_CACHED = "#a0a0a0"  # cached blocks nobody holds


@dataclass
class KVTimeline:
    """Per step: ``used`` / ``cached_free`` / ``free`` block counts and ``holders`` (block id ->
    ids of the requests holding it); ``cached_free_blocks`` the cached blocks nobody holds.
    Add it to ``LLMEngine.step_observers``; it is called with the engine after each step."""

    num_blocks: int = 0
    block_size: int = 0
    used: list[int] = field(default_factory=list)
    cached_free: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    holders: list[dict[int, list[str]]] = field(default_factory=list)
    cached_free_blocks: list[set[int]] = field(default_factory=list)

    def __call__(self, engine) -> None:
        kv = engine.scheduler.kv_cache_manager
        pool = kv.pool
        self.num_blocks, self.block_size = pool.num_blocks, kv.block_size
        holders: dict[int, list[str]] = {}
        for request in engine.scheduler.running:
            for block_id in request.block_ids:
                holders.setdefault(block_id, []).append(request.request_id)
        unheld = {b for b in pool.cached_blocks().values() if pool.ref_count(b) == 0}
        self.used.append(pool.num_used_blocks)
        self.cached_free.append(len(unheld))
        self.free.append(pool.num_free_blocks - len(unheld))
        self.holders.append(holders)
        self.cached_free_blocks.append(unheld)

    @property
    def num_steps(self) -> int:
        return len(self.used)

    def peak_step(self) -> int:
        """The first step with the most blocks in use."""
        return max(range(self.num_steps), key=lambda s: (self.used[s], -s)) if self.num_steps else 0


def draw_kv_timeline(timeline: KVTimeline, path, step: int | None = None) -> int:
    """Write ``timeline`` as a PNG of :data:`FIGURE_SIZE` at :data:`DPI` to ``path``; the block
    grid shows ``step`` (default: the peak step). Returns the step shown. ``ValueError`` if
    nothing was recorded or ``step`` is out of range; ``ImportError`` without matplotlib."""
    if not timeline.num_steps:
        raise ValueError("kv plot: no step was recorded (nothing was generated)")
    step = timeline.peak_step() if step is None else step
    if not 0 <= step < timeline.num_steps:
        raise ValueError(f"kv plot step: expected 0 .. {timeline.num_steps - 1}, got {step}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=FIGURE_SIZE, dpi=DPI, height_ratios=[1, 1.3])
    steps = range(timeline.num_steps)
    top.stackplot(steps, timeline.used, timeline.cached_free, timeline.free,
                  labels=["in use", "cached, free (reusable by a hit)", "free"],
                  colors=["#1f77b4", _CACHED, "#eeeeee"])
    busiest = max(u + c for u, c in zip(timeline.used, timeline.cached_free))
    top.set_ylim(0, min(timeline.num_blocks, max(8, int(busiest * 1.3))))
    top.axvline(step, color="black", linestyle="--", linewidth=1)
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("engine step")
    top.set_ylabel("KV blocks")
    top.set_title(f"KV pool: {timeline.num_blocks} blocks of {timeline.block_size} tokens "
                  f"(the axis stops at the busiest step; the rest is free)", fontsize=10)
    top.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)

    holders, unheld = timeline.holders[step], timeline.cached_free_blocks[step]
    requests = sorted({r for ids in holders.values() for r in ids}, key=_natural)
    shown = max([*holders, *unheld, 0]) + 1
    rows = -(-shown // _GRID_COLUMNS)
    grid = [[math.nan] * _GRID_COLUMNS for _ in range(rows)]  # 0 free, 1 cached, 2 shared, 3+ request; NaN: none
    for block_id in range(shown):
        ids = holders.get(block_id, [])
        if len(ids) > 1:
            value = 2
        elif ids:
            value = 3 + requests.index(ids[0])
        else:
            value = 1 if block_id in unheld else 0
        grid[block_id // _GRID_COLUMNS][block_id % _GRID_COLUMNS] = value
    palette = [c for c in plt.get_cmap("tab20").colors if len(set(c)) > 1]  # no greys: those are cached / free
    colours = ["#ffffff", _CACHED, "#000000"] + [palette[i % len(palette)] for i in range(len(requests))]
    bottom.pcolormesh(grid, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(colours) - 0.5,
                      edgecolors="#dddddd", linewidth=0.5)
    bottom.invert_yaxis()
    bottom.set_xticks([c + 0.5 for c in range(0, _GRID_COLUMNS, 8)], [str(c) for c in range(0, _GRID_COLUMNS, 8)])
    bottom.set_yticks([r + 0.5 for r in range(rows)], [str(r * _GRID_COLUMNS) for r in range(rows)], fontsize=7)
    bottom.set_xlabel("block id (row start + column)")
    bottom.set_title(f"step {step}: who holds each block (blocks 0 .. {shown - 1})", fontsize=10)
    legend = [Patch(color=colours[3 + i], label=_label(r)) for i, r in enumerate(requests[:12])]
    legend += [Patch(color="#000000", label="shared"), Patch(color=_CACHED, label="cached, free"),
               Patch(facecolor="#ffffff", edgecolor="#999999", label="free")]
    bottom.legend(handles=legend, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
    plt.close(fig)
    return step


def _natural(request_id: str) -> tuple:
    """Sort key: by request, then completion (parallel samples are ``"<completion>_<request>"``)."""
    completion, _, request = request_id.rpartition("_")
    return tuple(int(p) if p.isdigit() else p for p in (request, completion))


def _label(request_id: str) -> str:
    completion, _, request = request_id.rpartition("_")
    return f"request {request}, completion {completion}" if completion else f"request {request}"
