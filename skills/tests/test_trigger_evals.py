"""Trigger evals: each skill's evals/trigger_evals.json lists prompts that should and should not select it.

No model runs here; the tests check the format that eval runners (Anthropic's skill-creator, skills-bench)
read, and the content rules of this project: every skill has prompts in English and in Chinese on both
sides, every `expected_skill` names a skill that exists (or null for a prompt no skill should take), and
a prompt that should not select a skill names the skill that should take it instead, so that the evals of
neighbouring skills (vllm-serve-bench vs dbo-benchmark, dbo-debug vs profile-overlap-analysis) pull apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

SKILLS = Path(__file__).resolve().parents[1]
SKILL_NAMES = sorted(p.parent.name for p in SKILLS.glob("*/SKILL.md"))
KEYS = {"query", "should_trigger", "expected_skill"}
CJK = re.compile(r"[\u4e00-\u9fff]")


def eval_problems(skill: str, items: object, known: list[str]) -> list[str]:
    """Problems of one skill's trigger evals (empty when they are well formed)."""
    if not isinstance(items, list) or not items:
        return ["expected a non-empty JSON list of evals"]
    problems = []
    queries = set()
    for index, item in enumerate(items):
        where = f"item {index}"
        if not isinstance(item, dict) or set(item) != KEYS:
            problems.append(f"{where}: keys must be exactly {sorted(KEYS)}")
            continue
        query, trigger, expected = item["query"], item["should_trigger"], item["expected_skill"]
        if not isinstance(query, str) or len(query.strip()) < 8:
            problems.append(f"{where}: query must be a sentence")
        elif query in queries:
            problems.append(f"{where}: duplicate query")
        queries.add(query)
        if not isinstance(trigger, bool):
            problems.append(f"{where}: should_trigger must be true or false")
        if expected is not None and expected not in known:
            problems.append(f"{where}: expected_skill {expected!r} is not a skill")
        if trigger is True and expected != skill:
            problems.append(f"{where}: a prompt that should trigger {skill} must expect {skill}")
        if trigger is False and expected == skill:
            problems.append(f"{where}: a prompt that should not trigger {skill} expects it")
    for side in (True, False):
        texts = [i["query"] for i in items if isinstance(i, dict) and i.get("should_trigger") is side]
        label = "should" if side else "should-not"
        if len(texts) < 3:
            problems.append(f"fewer than 3 {label}-trigger prompts")
        if not any(CJK.search(t) for t in texts) or all(CJK.search(t) for t in texts):
            problems.append(f"{label}-trigger prompts need both English and Chinese")
    return problems


@pytest.mark.parametrize("skill", SKILL_NAMES)
def test_trigger_evals_are_well_formed(skill: str) -> None:
    path = SKILLS / skill / "evals" / "trigger_evals.json"
    assert eval_problems(skill, json.loads(path.read_text(encoding="utf-8")), SKILL_NAMES) == []


def test_every_skill_is_expected_by_another_skills_negative_prompt() -> None:
    """The neighbours' evals point at each skill: each one is the right answer to some other skill's decoy."""
    expected_elsewhere = set()
    for skill in SKILL_NAMES:
        items = json.loads((SKILLS / skill / "evals" / "trigger_evals.json").read_text(encoding="utf-8"))
        expected_elsewhere |= {i["expected_skill"] for i in items if not i["should_trigger"]}
    assert set(SKILL_NAMES) <= expected_elsewhere


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ({}, "non-empty JSON list"),
        ([{"query": "benchmark DBO please", "should_trigger": True}], "keys must be exactly"),
        ([{"query": "benchmark DBO please", "should_trigger": True, "expected_skill": "no-such"}], "is not a skill"),
        ([{"query": "benchmark DBO please", "should_trigger": True, "expected_skill": "b"}], "must expect a"),
        ([{"query": "benchmark DBO please", "should_trigger": "yes", "expected_skill": "a"}], "true or false"),
        ([{"query": "benchmark DBO please", "should_trigger": True, "expected_skill": "a"}] * 2, "duplicate query"),
        ([{"query": f"english prompt {i}", "should_trigger": True, "expected_skill": "a"} for i in range(3)],
         "should-trigger prompts need both English and Chinese"),
    ],
)
def test_the_format_check_rejects(items: object, expected: str) -> None:
    assert any(expected in p for p in eval_problems("a", items, ["a", "b"]))


@pytest.mark.parametrize(("skill", "words"), [
    ("kv-cache-sizing", ("910B", "fit")),                     # a budget that does not fit the device (issue 31)
    ("profile-overlap-analysis", ("no HCCL", "host")),        # a profile with no communication at all (issue 31)
])
def test_the_situations_a_newcomer_met_are_evals(skill: str, words: tuple[str, ...]) -> None:
    items = json.loads((SKILLS / skill / "evals" / "trigger_evals.json").read_text(encoding="utf-8"))
    english = [i for i in items if i["should_trigger"] and all(w in i["query"] for w in words)]
    chinese = [i for i in items if i["should_trigger"] and CJK.search(i["query"])
               and any(w in i["query"] for w in ("放得下", "没有任何通信"))]
    assert english and chinese
