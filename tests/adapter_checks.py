"""What every adapter of the batch step (AutoStep's plain loop, the Hugging Face Trainer, Lightning)
must show in its multi-rank cases: the same guarantees, asserted the same way."""

from __future__ import annotations

from typing import Any

from tests.toy_models import max_error

TOLERANCE = 1e-5


def check_steady_oom(run: dict[str, Any], one_rank: int, rank: int, batch: int = 5) -> None:
    """An OOM on `one_rank` in `batch`, after the sync hooks came off: one rerun of that batch at the
    same split on every rank, and the parameters of a plain loop at the splits used."""
    late = [h for h in run["history"] if h["batch"] == batch]
    assert [h["outcome"] for h in late] == ["oom", "ok"], run["history"]
    assert late[0]["hooks"] is False and late[0]["failed_ranks"] == [one_rank]
    results = run["results"]
    assert results[batch]["split"] == results[batch - 1]["split"] and results[batch]["attempts"] == 2, results
    assert max_error(run["params"], run["reference"]) <= TOLERANCE, rank
