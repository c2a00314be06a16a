"""DBO on/off precision comparison against any OpenAI-compatible vLLM server: greedy completions with logprobs
(``collect``), then text identity and logprob differences between two runs (``diff``).

Splitting a batch changes GEMM and attention shapes, so bit-identical output is not expected; what is expected is
the same greedy text on most prompts and small logprob differences where the texts agree.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.errors import DBOConfigError

__all__ = ["DEFAULT_PROMPTS", "collect", "diff_runs", "RunDiff", "write_json_atomic", "read_collect_result",
           "check_collect_result"]

DEFAULT_PROMPTS: tuple[str, ...] = (
    "Question: A train travels 60 km in 45 minutes. What is its speed in km per hour? Answer:",
    "Question: Tom has 3 boxes with 12 pencils each and gives away 7 pencils. How many are left? Answer:",
    "Explain in two sentences why the sky looks blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The weather is nice today and we will walk to the river.",
    "List three differences between TCP and UDP.",
    "Question: If 5 workers build a wall in 8 days, how long do 10 workers need? Answer:",
    "Summarize the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "What is the derivative of x^3 * sin(x)?",
    "Give a short definition of mixture-of-experts models.",
    "Question: A shop sells pens at 3 for 2 dollars. How much do 18 pens cost? Answer:",
    "Describe how a hash map handles collisions.",
    "Write a haiku about compilers.",
    "Question: The sum of two numbers is 50 and their difference is 12. What are they? Answer:",
    "Name the planets of the solar system in order from the sun.",
    "Why does overlapping communication with computation speed up distributed inference?",
)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temp file beside ``path`` and rename it into place (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def collect(base_url: str, model: str, prompts: Sequence[str], *, max_tokens: int = 64,
            timeout_s: float = 120.0, label: str = "", concurrency: int = 1) -> dict[str, Any]:
    """Greedy completion of every prompt (temperature 0, one logprob per token), one request per prompt.

    ``concurrency`` > 1 sends that many requests at once, so that the server batches them (decode batches of
    several requests are what DBO splits); results keep the prompts' order."""
    if concurrency < 1:
        raise DBOConfigError(f"concurrency={concurrency}: expected an integer >= 1")

    def one(prompt: str) -> dict[str, Any]:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "logprobs": 1, "seed": 0}).encode()
        req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                payload = json.loads(resp.read())
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
            if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
                raise DBOConfigError(f"{base_url}: the server's answer is not JSON; accepted: an OpenAI-compatible "
                                     "vLLM server") from None
            reason = " ".join(str(exc).split())[:200]
            raise DBOConfigError(f"{base_url}: completion request failed ({reason}); is the server up?") from None
        try:
            choice = payload["choices"][0]
            lp = choice.get("logprobs") or {}
            text = choice["text"]
            if not isinstance(text, str):
                raise TypeError(text)
            return {"prompt": prompt, "text": text, "tokens": list(lp.get("tokens") or []),
                    "logprobs": list(lp.get("token_logprobs") or [])}
        except (KeyError, IndexError, TypeError, AttributeError):
            raise DBOConfigError(f"{base_url}: the answer has no completion text (choices[0].text); accepted: an "
                                 "OpenAI-compatible vLLM server's /v1/completions") from None

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, prompts))
    return {"label": label, "model": model, "url": base_url, "max_tokens": max_tokens, "results": results}


@dataclass(frozen=True)
class RunDiff:
    prompts: int
    identical: int
    first_divergence: tuple[int | None, ...]  # token index of the first different token, None if identical
    compared_tokens: int
    max_abs_logprob_diff: float
    mean_abs_logprob_diff: float

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.prompts if self.prompts else 1.0


MAX_COLLECT_BYTES = 1 << 30
_ACCEPTED = "accepted: the JSON written by `dbo-runtime compare collect`"


def read_collect_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``collect`` result read from ``path`` and checked item by item (:func:`check_collect_result`)."""
    import stat

    shown = os.fspath(path)[:200]
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise DBOConfigError(f"{shown}: not a regular file; {_ACCEPTED}")
        if info.st_size > MAX_COLLECT_BYTES:
            raise DBOConfigError(f"{shown}: {info.st_size:,} bytes, more than a collect result can be "
                                 f"({MAX_COLLECT_BYTES:,}); {_ACCEPTED}")
        with open(path, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except OSError as exc:
        raise DBOConfigError(f"{shown}: cannot read ({exc.strerror}); {_ACCEPTED}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise DBOConfigError(f"{shown}: not JSON text; {_ACCEPTED}") from None
    return check_collect_result(data, shown)


def check_collect_result(data: Any, where: str = "collect result") -> dict[str, Any]:
    """``data`` if it is a collect result: an object whose ``results`` list holds objects with a string ``prompt``
    and ``text``, and optional ``tokens`` (a list) and ``logprobs`` (numbers or null); else DBOConfigError naming
    the first item and field that is not."""
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise DBOConfigError(f"{where}: not a collect result (no 'results' list); {_ACCEPTED}")
    for i, item in enumerate(data["results"]):
        if not isinstance(item, dict):
            raise DBOConfigError(f"{where}: results[{i}] is a {type(item).__name__}, not an object; {_ACCEPTED}")
        for key in ("prompt", "text"):
            if not isinstance(item.get(key), str):
                what = "missing" if key not in item else f"a {type(item[key]).__name__}, not a string"
                raise DBOConfigError(f"{where}: results[{i}].{key} is {what}; {_ACCEPTED}")
        for key in ("tokens", "logprobs"):
            if item.get(key) is not None and not isinstance(item[key], list):
                raise DBOConfigError(f"{where}: results[{i}].{key} is a {type(item[key]).__name__}, not a list; "
                                     f"{_ACCEPTED}")
        for j, value in enumerate(item.get("logprobs") or []):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise DBOConfigError(f"{where}: results[{i}].logprobs[{j}] is {str(value)[:40]!r}, not a number; "
                                     f"{_ACCEPTED}")
            if value is not None and not math.isfinite(value):  # JSON's NaN/Infinity: no comparison holds
                raise DBOConfigError(f"{where}: results[{i}].logprobs[{j}] is {value!r}, not a finite number; "
                                     f"{_ACCEPTED}")
    return data


def diff_runs(a: dict[str, Any], b: dict[str, Any]) -> RunDiff:
    """Compare two ``collect`` results prompt by prompt. Logprobs are compared over each prompt's common token
    prefix (after the first different token the two continuations condition on different text)."""
    ra = check_collect_result(a, "first run")["results"]
    rb = check_collect_result(b, "second run")["results"]
    if not ra or not rb:
        raise DBOConfigError("a run has no completions, so nothing can be compared; accepted: two collect runs of the "
                             "same prompts, at least one prompt each")
    if [r["prompt"] for r in ra] != [r["prompt"] for r in rb]:
        raise DBOConfigError("the two runs used different prompts; accepted: two collect runs of the same prompts")
    identical, divergence, diffs = 0, [], []
    for x, y in zip(ra, rb, strict=True):
        tx, ty = list(x.get("tokens") or []), list(y.get("tokens") or [])
        first = next((i for i, (p, q) in enumerate(zip(tx, ty, strict=False)) if p != q), None)
        if first is None and len(tx) != len(ty):
            first = min(len(tx), len(ty))
        same = x["text"] == y["text"]
        identical += same
        divergence.append(None if same else first)
        common = len(tx) if first is None else first
        for p, q in zip((x.get("logprobs") or [])[:common], (y.get("logprobs") or [])[:common], strict=False):
            if p is not None and q is not None:
                diffs.append(abs(p - q))
    if identical and not diffs:
        # identical texts with not one token whose logprobs both runs give: empty completions, or runs without
        # tokens/logprobs; "100% identical" would rest on nothing
        raise DBOConfigError(f"the runs' {identical} identical completion(s) have no token with a logprob in both "
                             "runs (0 common tokens), so nothing was compared; accepted: two collect runs whose "
                             "completions have tokens and logprobs")
    return RunDiff(len(ra), identical, tuple(divergence), len(diffs), max(diffs, default=0.0),
                   sum(diffs) / len(diffs) if diffs else 0.0)


def diff_report(d: RunDiff) -> dict[str, Any]:
    return dict(asdict(d), identical_fraction=d.identical_fraction)
