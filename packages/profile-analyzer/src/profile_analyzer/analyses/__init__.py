"""Analyses: pure functions of a Timeline / RankTimeline (no I/O, no printing)."""
