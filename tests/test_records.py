"""The dashboards' records and the failure note, without Composer or processes."""

from __future__ import annotations

import json

from automicro.core import failure_note
from automicro.core.metrics import (
    AttemptRecord,
    BatchFigures,
    batch_metrics,
    event_traces,
    history_from_state,
    history_to_state,
)
from automicro.core.sites import ALL_SITES


def _history() -> list[AttemptRecord]:
    return [
        AttemptRecord(batch=0, attempt=1, size=8, split=(8,), outcome="oom", failed_ranks=[1], sites=["backward"], next_size=4),
        AttemptRecord(batch=0, attempt=2, size=4, split=(4, 4), outcome="ok", next_size=6),
        AttemptRecord(batch=1, attempt=1, size=6, split=(6, 2), outcome="oom", failed_ranks=[0, 1], sites=["forward_pre"], next_size=5),
        AttemptRecord(batch=1, attempt=2, size=5, split=(5, 3), outcome="thrash", next_size=4),
        AttemptRecord(batch=1, attempt=3, size=4, split=(4, 4), outcome="ok", next_size=4),
    ]


def test_event_traces_are_the_failed_attempts_of_that_batch_oldest_first():
    traces = event_traces(_history(), 1)
    events = [t["automicro/event"] for t in traces]
    assert [(e["attempt"], e["outcome"]) for e in events] == [(1, "oom"), (2, "thrash")]
    assert events[0]["site"] == "forward_pre" and events[0]["site_index"] == ALL_SITES.index("forward_pre")
    assert events[1]["site"] == "" and events[1]["site_index"] == -1
    assert [t["automicro/event"]["batch"] for t in event_traces(_history()[:2], 0)] == [0]
    assert event_traces(_history(), 2) == []


def test_batch_metrics_name_the_last_oom_and_the_split():
    figures = BatchFigures((4, 4), 3, 2, False, True, 1, 0.5, True, 4)
    metrics = batch_metrics(figures, _history())
    assert metrics["automicro/microbatch_size"] == 4 and metrics["automicro/num_microbatches"] == 2
    assert (metrics["automicro/last_oom_rank"], metrics["automicro/last_oom_site"]) == (0, ALL_SITES.index("forward_pre"))
    assert (metrics["automicro/alloc_retries"], metrics["automicro/searching"], metrics["automicro/hooks_active"]) == (1, 0, 1)
    assert batch_metrics(figures, [])["automicro/last_oom_rank"] == -1


def test_history_survives_a_checkpoint_as_plain_data():
    rows = json.loads(json.dumps(history_to_state(_history())))
    assert history_from_state(rows) == _history()


def test_failure_note_round_trip_and_when_it_applies(tmp_path):
    assert failure_note.read(str(tmp_path)) is None
    assert failure_note.write(None, 0, 5, (4, 4)) is None and failure_note.write("s3://bucket/run", 0, 5, (4, 4)) is None
    path = failure_note.write(str(tmp_path / "ckpt"), 1, 7, (6, 2))
    note = failure_note.read(str(tmp_path / "ckpt"))
    assert note is not None and note.path == path and (note.batch, note.split, note.size) == (7, (6, 2), 6)
    assert note.applies(resumed_at_batch=5, size_in_use=6)
    assert not note.applies(resumed_at_batch=8, size_in_use=6)  # a failure before the checkpoint resumed from
    assert not note.applies(resumed_at_batch=5, size_in_use=4)  # below the size that failed: safe
    # The size shrank after the checkpoint and then failed: the relaunch would start above it.
    assert note.applies(resumed_at_batch=5, size_in_use=8)
    assert list((tmp_path / "ckpt").iterdir()) == [tmp_path / "ckpt" / failure_note.FILE_NAME]  # no temporary left


def test_a_site_only_listeners_act_on_is_known_to_be_listened_to_and_removal_forgets_it():
    from automicro.engine.hooks import SYNC_SITES
    from automicro.core.sites import SiteDispatcher

    sites = SiteDispatcher()
    assert not sites.listens("loss")
    remove_sync = sites.add(lambda *a: None, 100, sites=SYNC_SITES)
    # The sync hooks never act at the loss, so firing it would only move `last_site`.
    assert sites.listens("backward") and not sites.listens("loss")
    remove_fault = sites.add(lambda *a: None, 0, sites=("loss",))
    assert sites.listens("loss")
    remove_fault()
    assert not sites.listens("loss") and sites.listens("backward")
    remove_sync()
    assert not sites.listens("backward") and len(sites) == 0
