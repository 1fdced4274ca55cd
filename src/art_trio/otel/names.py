"""The spans' and attributes' names: the vocabulary a trace query uses.

Spans: `art_trio.run` (one per traced run), under it `art_trio.rollout`, `art_trio.train`,
`art_trio.eval` and `art_trio.stall`. Attribute names are namespaced `art_trio.` as
OpenTelemetry asks of names outside its semantic conventions.
"""

from __future__ import annotations

RUN = "art_trio.run"
ROLLOUT = "art_trio.rollout"
TRAIN = "art_trio.train"
EVAL = "art_trio.eval"
STALL = "art_trio.stall"

# A rollout: its scenario, its worker slot (lane), the policy last published when it
# started, the group's own version as the trainer received it, how it ended.
SCENARIO = "art_trio.scenario.index"
LANE = "art_trio.rollout.lane"
START_VERSION = "art_trio.rollout.start_version"
#: The run span's policy version it started from (set at the run's first event).
RUN_POLICY_VERSION = "art_trio.run.policy_version"
GROUP_VERSION = "art_trio.group.policy_version"
FATE = "art_trio.rollout.fate"
SPENT_S = "art_trio.rollout.spent_s"
# A trained group's staleness: the step it trained in, its age in steps from its version and
# weighted by its tokens' own versions, its seconds queued (handed over until its batch was
# taken).
STEP = "art_trio.step"
AGE_STEPS = "art_trio.group.age_steps"
AGE_TOKENS = "art_trio.group.age_tokens"
QUEUED_S = "art_trio.group.queued_s"

# A training call: the groups of its batch, their ages, the batch's token-weighted age and
# tokens, the seconds inside backend.train, the version it published, whether it completed.
GROUPS = "art_trio.train.groups"
SCENARIOS = "art_trio.train.scenario_indices"
AGES = "art_trio.train.age_steps"
TOKEN_AGE = "art_trio.train.token_age"
TOKENS = "art_trio.train.tokens"
TRAIN_S = "art_trio.train.train_s"
PUBLISHED = "art_trio.train.published_version"
COMPLETED = "art_trio.completed"
REWARD = "art_trio.reward"

# A stall, and how the run ended.
STALL_S = "art_trio.stall.seconds"
STALL_REPEAT = "art_trio.stall.repeat"
BLOCKED_LOOP = "art_trio.stall.blocked_loop"
OUTCOME = "art_trio.run.outcome"

# Span events.
EV_PUBLISHED = "policy.published"
EV_CANCELLED = "rollout.cancelled"
EV_GIVEN_BACK = "rollout.given_back"
EV_RESIZED = "run.resized"
EV_COLLAPSED = "run.collapsed"
EV_RUN_CANCELLED = "run.cancelled"
