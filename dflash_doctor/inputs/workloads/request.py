"""One request to replay (:class:`Request`): its class and subclass, the conversation or raw prompt, and
how many turns replay asks for; :func:`stratified_sample` picks requests so that every class keeps its share.

Its own module because every room reads a Request (replay, serving, tune, training) while only a few
load workloads.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class Request:
    """One request to replay.

    ``messages``: OpenAI chat messages ``[{"role", "content"}]``; trailing user messages are replayed
    as separate turns (module doc). ``prompt``: raw text tokenised without a chat template.
    ``response``: a recorded answer, kept for teacher-forced replay when the user asks for it.
    ``chat_template_kwargs`` reach the chat template (e.g. ``{"enable_thinking": false}``).
    """

    id: str
    request_class: str = "default"
    subclass: str = ""
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a Request has exactly one of messages or prompt")

    @property
    def num_turns(self) -> int:
        """How many answers replay asks for: one per trailing user message, one for a raw prompt."""
        if self.messages is None:
            return 1
        return max(1, count_trailing_user_messages(self.messages))


def _allocate(sizes: dict[str, int], total: int, rng: random.Random) -> dict[str, int]:
    """Split ``total`` slots over groups as evenly as their sizes allow (water filling); slots that
    cannot be shared evenly go to groups drawn with ``rng``."""
    allocation = dict.fromkeys(sizes, 0)
    remaining = min(total, sum(sizes.values()))
    while remaining:
        open_groups = sorted(g for g in sizes if allocation[g] < sizes[g])
        share = remaining // len(open_groups)
        if share == 0:
            for group in rng.sample(open_groups, remaining):
                allocation[group] += 1
            break
        for group in open_groups:
            added = min(share, sizes[group] - allocation[group])
            allocation[group] += added
            remaining -= added
    return allocation


def stratified_sample(requests: list[Request], max_requests: int, seed: int) -> list[Request]:
    """At most ``max_requests``, equal shares per class and per subclass within a class, in input order."""
    if max_requests >= len(requests):
        return list(requests)
    rng = random.Random(seed)
    indices: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, request in enumerate(requests):
        indices[request.request_class][request.subclass].append(index)
    chosen: list[int] = []
    per_class = _allocate({c: sum(map(len, subs.values())) for c, subs in indices.items()}, max_requests, rng)
    for request_class in sorted(indices):
        subclasses = indices[request_class]
        per_subclass = _allocate({s: len(ix) for s, ix in subclasses.items()}, per_class[request_class], rng)
        for subclass in sorted(subclasses):
            chosen.extend(rng.sample(subclasses[subclass], per_subclass[subclass]))
    return [requests[i] for i in sorted(chosen)]


def count_trailing_user_messages(messages: Sequence[dict[str, Any]]) -> int:
    count = 0
    while count < len(messages) and messages[len(messages) - 1 - count]["role"] == "user":
        count += 1
    return count
