"""The soak in short (tests/soak.py; the long run is `python -m tests.soak --minutes 10`): kill/restart cycles of
the training loop, saving every step; nothing committed may be lost, no restore may be inexact."""

from __future__ import annotations

from soak import run_soak, table


def test_three_kill_restart_cycles_lose_nothing(tmp_path) -> None:
    # W=2 killed while a save is being written, resumed on W=2 (the first loss must be bit-identical), then
    # killed at a random moment and resumed on a single rank.
    report = run_soak(str(tmp_path / "root"), cycles=3, worlds=[2, 2, 1], modes=["after-step", "random", "random"])
    summary = table(report)
    assert len(report.cycles) == 3 and all(c.killed_rank is not None for c in report.cycles), summary
    assert report.failures == [] and report.lost == [], summary
    assert report.wrong_resumes == [] and report.not_exact == [] and report.not_close == [], summary
    assert [c.resumed is not None for c in report.cycles] == [False, True, True], summary
    assert report.committed_seen and report.ok, summary


def test_kills_during_incremental_saves_lose_nothing_they_reference(tmp_path) -> None:
    # A frozen base saved incrementally every step (a full save every third): a kill lands in a save that
    # references older checkpoints, retention (keep_last 3) prunes around references, the resume on another
    # world size reads referenced bytes; gc at the end keeps what the survivors reference, and all verify.
    report = run_soak(str(tmp_path / "root"), cycles=2, worlds=[2, 1], modes=["after-step", "random"], incremental=True)
    summary = table(report)
    assert [c.killed_rank is not None for c in report.cycles] == [True, True], summary
    assert report.failures == [] and report.lost == [], summary
    assert report.wrong_resumes == [] and report.not_exact == [] and report.not_close == [], summary
    assert report.cycles[1].resumed is not None and report.ok, summary
    assert len(report.referencing_seen) >= 2, summary  # the incremental saves did store pieces by reference


def test_node_losses_resume_from_the_local_tier_exactly(tmp_path) -> None:
    # Two simulated nodes of one rank (a torchrun agent each, a local tier directory each, peers=1): node loss
    # while a local save is written (its agent and rank SIGKILLed, its directory wiped), then the restart on the
    # survivor plus a new, empty node must resume from the newest local step, and bit-exactly.
    report = run_soak(
        str(tmp_path / "root"), cycles=2, layouts=[[1, 1]], modes=["after-step", "after-step"], local_tier=True, seed=3
    )
    summary = table(report)
    assert [c.killed_node is not None for c in report.cycles] == [True, True], summary
    assert report.failures == [] and report.lost == [], summary
    assert report.wrong_resumes == [] and report.not_exact == [] and report.not_close == [], summary
    resumed = report.cycles[1]
    assert resumed.source is not None and resumed.source.startswith("local:"), summary  # step 1 or 2: local ones
    assert report.exact == 1 and report.local_resumes == 1 and report.ok, summary
