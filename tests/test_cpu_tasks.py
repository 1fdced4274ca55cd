"""The real-model tasks' pure parts (no model loaded): the list task's scoring, feedback and
scenarios, and `art-trio demo --task` routing. tests/test_cpu_llm.py runs them on the model."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

pytest.importorskip("torch")

from art_trio.cpu.tasks import (  # noqa: E402
    DISTINCT_WORDS,
    EXPLAIN_WORDS,
    TASKS,
    feedback,
    get_task,
    list_items,
    list_scenarios,
    rollout_reward,
    score_distinct,
    score_explained,
    score_list,
    score_reasoned,
)
from art_trio.demo.cli import main  # noqa: E402


def test_a_right_list_scores_one() -> None:
    assert score_list("apple, banana, cherry, plum, kiwi", 5) == 1.0
    assert score_list("Apple, Banana, Cherry, Plum, Kiwi.", 5) == 1.0


def test_scores_are_graded() -> None:
    # One item short: the count is 4/5 right.
    assert score_list("apple, banana, cherry, plum", 5) == pytest.approx(0.8)
    # Right count, one item is prose: 4 of 5 well formed.
    text = "apple, banana, cherry, plum, the fruit that grows on vines in Spain"
    assert score_list(text, 5) == pytest.approx(0.8)
    # Numbered lines with no commas are one malformed item.
    assert score_list("1. apple\n2. banana\n3. cherry", 3) == 0.0
    assert score_list("", 3) == 0.0
    # Far too many items: no credit for the count.
    assert score_list(", ".join(["x"] * 20), 5) == 0.0


def test_list_items_ignore_empty_pieces() -> None:
    assert list_items("a, , b,c.") == ["a", "b", "c"]


def test_feedback_says_what_was_wrong() -> None:
    note = feedback("apple, banana", 5)
    assert "You gave 2 items" in note and "exactly 5" in note
    assert "three words" in feedback("1. apple, banana", 2)
    assert "three words" not in feedback("apple, banana", 5)


def test_rollout_reward_credits_turns_saved() -> None:
    assert rollout_reward([1.0], 2) == 1.0  # right at once
    assert rollout_reward([0.2, 1.0], 2) == pytest.approx(0.6)  # fixed on the second turn
    assert rollout_reward([0.2, 0.4], 2) == pytest.approx(0.3)  # never right
    assert rollout_reward([0.5], 1) == 0.5


def test_list_scenarios_are_seeded_and_cover_every_pair() -> None:
    first = list(islice(list_scenarios(3), 64))
    assert first == list(islice(list_scenarios(3), 64))
    assert first != list(islice(list_scenarios(4), 64))
    assert len({s["metadata"]["scenario_id"] for s in first}) == 64
    assert all(f"exactly {s['k']} " in s["prompt"] for s in first)


def test_explained_answers_score_the_first_word_and_the_reason() -> None:
    reason = " ".join(["because"] * EXPLAIN_WORDS)
    assert score_explained(f"Maybe. {reason}") == 1.0
    assert score_explained(f"no, {reason}") == 0.75
    assert score_explained("Maybe.") == 0.5  # no reason: half
    assert score_explained(f"Well, {reason}") == 0.0
    config = TASKS["explain"].config(group_size=4, seed=1)
    assert config.max_tokens >= 32
    assert config.score is score_explained


def test_reasoned_answers_earn_the_verdict_in_proportion_to_the_reason() -> None:
    reason = " ".join(["because"] * EXPLAIN_WORDS)
    half_reason = " ".join(["because"] * (EXPLAIN_WORDS // 2))
    assert score_reasoned(f"Maybe. {reason}") == 1.0
    assert score_reasoned(f"no, {reason} and more words") == 0.75  # full at EXPLAIN_WORDS
    assert score_reasoned(f"Maybe {half_reason}") == 0.75
    assert score_reasoned("Maybe.") == 0.5  # a bare verdict: half
    assert score_reasoned(f"I'd say maybe: {reason}") == 0.5  # a late verdict: half
    assert score_reasoned(f"\u201cNo\u201d {reason}") == 0.75
    assert score_reasoned(f"One two three four five six maybe {reason}") == 0.0  # too late
    assert score_reasoned(f"Well, {reason}") == 0.0
    assert score_reasoned("") == 0.0
    config = TASKS["reasoned"].config(group_size=4, seed=1)
    assert config.max_tokens >= 32
    assert config.score is score_reasoned


def test_distinct_answers_earn_the_reason_by_its_distinct_words() -> None:
    varied = " ".join(f"w{i}" for i in range(DISTINCT_WORDS))
    half_varied = " ".join(f"w{i}" for i in range(DISTINCT_WORDS // 2))
    assert score_distinct(f"Maybe. {varied}") == 1.0
    assert score_distinct(f"No, {half_varied}") == pytest.approx(0.75 * 0.75)
    # Padding: one word repeated is one distinct word, whatever its length.
    padded = " ".join(["no"] * DISTINCT_WORDS)
    assert score_distinct(f"No {padded}") == pytest.approx(0.75 * (1 + 1 / DISTINCT_WORDS) / 2)
    assert score_distinct(f"Maybe. {half_varied}, {half_varied.upper()}!") == score_distinct(
        f"Maybe {half_varied}"
    )  # case and punctuation do not make a word new
    assert score_distinct(f"I'd say maybe: {varied}") == 0.5  # a late verdict: half
    assert score_distinct(f"Well, {varied}") == 0.0
    assert score_distinct("") == 0.0
    config = TASKS["distinct"].config(group_size=4, seed=1)
    assert config.max_tokens >= 32
    assert config.score is score_distinct


def test_tasks_by_name() -> None:
    assert set(TASKS) == {"yes-no-maybe", "explain", "reasoned", "distinct", "list", "lookup"}
    with pytest.raises(
        ValueError, match="choose one of distinct, explain, list, lookup, reasoned, yes-no-maybe"
    ):
        get_task("chess")


def test_demo_task_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--task", "list", "--output-dir", str(tmp_path)]) == 2
    assert "--task needs --model" in capsys.readouterr().err
    assert main(["--model", "smollm2", "--task", "chess", "--output-dir", str(tmp_path)]) == 2
    assert "unknown --task 'chess'" in capsys.readouterr().err
