"""Fault matrices, sampled: every CI run draws its own cases, every run covers every site.

A fault matrix crosses the sites a fault can hit (forward, backward, the collectives, ...) with
who fails (one rank, every rank), where (the first or the last microbatch), the sync hooks on or
off, the schedule. Running every cell on every CI run costs most of CI's time; each cell guards the
same code as its neighbours on the other axes. So CI runs a sample: per value of the matrix's main
axis (the site, usually), at least `per_key` cells drawn from that value's row, the draw seeded.
Over CI runs every cell comes up; `make test-full` (pytest `--full`) runs every cell at once.

The seed: `AUTOMICRO_TEST_SEED` (an int) where set, else drawn at the start of the pytest run;
pytest's header and its last lines print it, with how to repeat the draw. Test IDs name the cell,
so a failing cell is rerun by its ID as well. A matrix's draw also depends on torch's version
(major.minor): CI's three legs run one seed (`.ci/run` sets it) and each leg draws its own cells.

`shares`: CI's torch 2.11 and 2.15 legs split the launches of the tests that differ between torch
versions between them, dealt per test file with the same seed (`tests/conftest.py`).
"""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Optional, TypeVar

T = TypeVar("T")

SEED_ENV = "AUTOMICRO_TEST_SEED"
FULL_ENV = "AUTOMICRO_FULL_MATRIX"


def full() -> bool:
    """Whether every cell runs (`pytest --full` or `--every`, `make test-full`, or AUTOMICRO_FULL_MATRIX=1)."""
    return os.environ.get(FULL_ENV, "") not in ("", "0")


def seed() -> int:
    """This run's seed (`tests/conftest.py` sets it before the test modules are imported)."""
    value = os.environ.get(SEED_ENV, "")
    if not value:
        value = str(random.SystemRandom().randrange(2**31))
        os.environ[SEED_ENV] = value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={value!r}: must be an int (the seed a CI run printed)") from None


DRAWN: dict[str, tuple[int, int]] = {}  # matrix name -> (cells run, cells in all): the summary line


def sample(
    name: str, cells: Sequence[T], key: Callable[[T], Hashable] = lambda cell: cell[0],  # type: ignore[index]
    per_key: int = 1, always: Optional[Callable[[T], bool]] = None,
) -> list[T]:
    """The cells of matrix `name` this run takes, in their own order: for each value of `key(cell)`,
    `per_key` of its cells (all where it has fewer), drawn with this run's seed and the matrix's
    name; `always(cell)` keeps a cell in every run. Every cell under `full()`."""
    cells = list(cells)
    if len(set(map(repr, cells))) != len(cells):
        raise ValueError(f"matrix {name!r}: a cell appears twice")
    if full():
        DRAWN[name] = (len(cells), len(cells))
        return cells
    rng = random.Random(f"{seed()}:{name}:{_torch_minor()}")
    rows: dict[Hashable, list[int]] = {}
    for index, cell in enumerate(cells):
        rows.setdefault(key(cell), []).append(index)
    chosen = {i for i, cell in enumerate(cells) if always is not None and always(cell)}
    for row in rows.values():
        kept = [i for i in row if i in chosen]  # a cell kept always counts toward its row's draw
        rest = [i for i in row if i not in chosen]
        chosen.update(rng.sample(rest, min(max(0, per_key - len(kept)), len(rest))))
    DRAWN[name] = (len(chosen), len(cells))
    return [cell for i, cell in enumerate(cells) if i in chosen]


def _torch_minor() -> str:
    import torch

    return ".".join(torch.__version__.split(".")[:2])


def parse_share(text: str) -> tuple[int, int]:
    """`K/N` (pytest's `--versions-share`): the K-th of N shares, 1 <= K <= N."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if match is None or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ValueError(f"--versions-share={text!r}: expected K/N with 1 <= K <= N, e.g. 1/2 (torch 2.11's leg) and 2/2 (2.15's)")
    return int(match.group(1)), int(match.group(2))


def shares(name: str, groups: Sequence[tuple[str, Hashable]], part: int, parts: int) -> set[tuple[str, Hashable]]:
    """The groups share `part` of `parts` takes. `groups`: (file, group) pairs (a group: the tests that
    share one launch). Per file, its groups are dealt over the shares in a seeded order (the torch
    version left out: every leg deals alike, so the shares are complementary); a file with fewer
    groups than shares is dealt whole to one share (seeded), so every launch runs on exactly one
    share and no launch twice (its tests that launch nothing still run on every leg). Every group
    under `full()`."""
    by_file: dict[str, list[Hashable]] = {}
    for file, group in groups:
        by_file.setdefault(file, [])
        if group not in by_file[file]:
            by_file[file].append(group)
    total = sum(map(len, by_file.values()))
    if full():
        DRAWN[name] = (total, total)
        return {(file, group) for file, row in by_file.items() for group in row}
    taken: set[tuple[str, Hashable]] = set()
    for file in sorted(by_file):
        row = sorted(by_file[file], key=repr)
        if len(row) < parts:
            continue
        random.Random(f"{seed()}:{name}:{file}").shuffle(row)
        taken.update((file, group) for index, group in enumerate(row) if index % parts == part - 1)
    # The files with fewer launches than shares, dealt whole over the shares (seeded, balanced).
    small = sorted(file for file, row in by_file.items() if len(row) < parts)
    random.Random(f"{seed()}:{name}:small files").shuffle(small)
    for index, file in enumerate(small):
        if index % parts == part - 1:
            taken.update((file, group) for group in by_file[file])
    DRAWN[f"{name} {part}/{parts}"] = (len(taken), total)
    return taken


def parse_fraction(text: str) -> float:
    """`S` (pytest's `--launch-share`): a share in (0, 1]."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ValueError(f"--launch-share={text!r}: expected a number in (0, 1], e.g. 0.5 (half of each file's launches)")
    return value


def share_of(name: str, launches: dict[str, list[Hashable]], share: float,
             elsewhere: Iterable[str] = ()) -> set[tuple[str, Hashable]]:
    """Of each file's launches, a seeded `share` (rounded up, at least one): (file, launch) pairs. A file in
    `elsewhere` (its launches run on another leg of this CI run too: the newer torch legs' files that leg 1 runs
    whole) may draw none: its count is `share` x its launches rounded up or down at random (seeded), so each of its
    launches still runs with probability `share`. Every launch under `full()`."""
    total = sum(map(len, launches.values()))
    if full() or share >= 1.0:
        DRAWN[name] = (total, total)
        return {(file, launch) for file, row in launches.items() for launch in row}
    elsewhere = set(elsewhere)
    taken: set[tuple[str, Hashable]] = set()
    for file in sorted(launches):
        row = sorted(launches[file], key=repr)
        rng = random.Random(f"{seed()}:{name}:{file}:{_torch_minor()}")
        if file in elsewhere:
            count = min(len(row), math.floor(share * len(row) + rng.random()))
        else:
            count = max(1, math.ceil(share * len(row)))
        taken.update((file, launch) for launch in rng.sample(row, count))
    DRAWN[f"{name} {share:.2f}"] = (len(taken), total)
    return taken


def summary() -> str:
    """One line: the seed, and what each matrix ran of its cells."""
    if not DRAWN:
        return ""
    how = "every cell (--full or --every)" if full() else f"seed {seed()} ({SEED_ENV}={seed()} repeats it; --full runs every cell)"
    parts = ", ".join(f"{name} {ran}/{total}" for name, (ran, total) in sorted(DRAWN.items()))
    return f"fault matrices: {how}: {parts}"


def configure(config: Any) -> None:
    """From `tests/conftest.py`'s pytest_configure: `--full` or `--every`, and the seed fixed for the run."""
    if config.getoption("--full", default=False) or config.getoption("--every", default=False):
        os.environ[FULL_ENV] = "1"
    seed()
