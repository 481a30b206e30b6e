"""Why the draft is rejected, in aggregate: deviation patterns per request class.

The token viewer shows one request at a time; this module answers the question a user asks before
spending GPU days on retraining: *which* deviations cost the most accepted tokens across the workload,
and could better training fix them? Everything is computed from a run directory's tables (``tokens``,
``steps``, ``requests``) with vectorised pandas/numpy, so a 1M-token run takes seconds
(``benchmarks/deviations.py`` prints the time).

Definitions (the reports print them next to the numbers):

* A step's **first rejection** is its drafted token at slot ``num_accepted + 1``, in a step that
  verification ended by rejecting a token. Steps ended by an accepted stop token or by the end of the
  known output (``bonus_token == -1``) have none. Slots after the first rejection were never verified
  on the committed context, so they count nowhere here.
* Its **lost tokens** are the drafted tokens the step threw away, ``num_drafted - num_accepted`` (the
  rejected token and every slot after it). Patterns are ranked by lost tokens, not by counts: a miss at
  slot 1 of a 15-token block costs 15, a miss at slot 15 costs 1.
* A drafted token is **decided** when verification looked at it: it was accepted or it is its step's
  first rejection. The acceptance rate of a category or a bin is ``accepted / decided``: the chance the
  draft gets that token right *given it got that far*, which is what a slot-independent view needs.
* A first rejection is a **confident miss** when the target was sure of its own token: entropy at most
  ``max_entropy`` nats *and* top-1 margin ``p1 - p2`` at least ``min_margin`` (temperature-1
  distributions, as recorded). Training can fix those. Otherwise it is **uncertain**: the target itself
  was near a tie, and at T = 0 such a miss is irreducible (a draft cannot reliably learn a coin flip,
  and numerics can flip it between engines). Runs recorded before ``target_top1_margin`` existed are
  judged by entropy alone.
* **Attainable tau** (an upper bound): ``1 + (accepted + credited tokens) / num_drafts`` over this run's
  steps, where a step whose first rejection is a confident miss is credited what accepting its confident
  misses would add. In a teacher-forced run (``check``, ``sweep``) the slots after a first rejection still
  hold the draft's guess and the target's token on the committed context, so the credit walks on through
  matches and confident misses up to the first uncertain miss. Live-loop rows (``replay``) after a
  rejection were drafted on the rejected prefix, so there the whole remaining block is credited. Either
  way every confident miss is assumed fixed and nothing else changed, and the schedule is not
  re-simulated: it bounds what such training could buy and is not a prediction. tau is vLLM's (bonus
  token included).

Token categories come from the tokenizer's own token strings (:class:`TokenCategories`), recorded in
the ``target_category`` column when the run is written, because the views load no tokenizer.

The package, by job: :mod:`.categories` (token categories from a tokenizer, recorded when a run is
written), :mod:`.decided` (the run's tables joined once into the decided-token frame), :mod:`.why_rejected`
(the statistics, returned as the typed :class:`DeviationAnalysis` every view reads) and :mod:`.patterns`
(the patterns that grew between two runs, for ``compare``). Callers import the names below from here.
"""

from dflash_doctor.stats.deviations.categories import (
    CATEGORIES,
    UNCATEGORISED,
    TokenCategories,
    categorize,
    special_token_ids,
)
from dflash_doctor.stats.deviations.decided import (
    ConfidenceRule,
    DeviationTables,
    class_names,
    deviation_tables,
    run_tables,
    select,
)
from dflash_doctor.stats.deviations.why_rejected import (
    CONTEXT_LENGTH_EDGES,
    DEFAULT_TOP_N,
    OUTPUT_POSITION_EDGES,
    BinRow,
    CategoryRow,
    Definitions,
    DeviationAnalysis,
    MissShare,
    MissSplit,
    PatternExample,
    RejectionPair,
    SliceAnalysis,
    analyze,
    analyze_run,
    binned_acceptance,
    category_table,
    definitions,
    miss_split,
    pair_table,
    slice_summary,
)
from dflash_doctor.stats.deviations.patterns import (
    GROWTH_MIN_LOST_PER_DRAFT,
    PATTERN_KINDS,
    grown_patterns,
    pattern_costs,
)

__all__ = [
    "CATEGORIES",
    "UNCATEGORISED",
    "TokenCategories",
    "categorize",
    "special_token_ids",
    "ConfidenceRule",
    "DeviationTables",
    "class_names",
    "deviation_tables",
    "run_tables",
    "select",
    "CONTEXT_LENGTH_EDGES",
    "DEFAULT_TOP_N",
    "OUTPUT_POSITION_EDGES",
    "BinRow",
    "CategoryRow",
    "Definitions",
    "DeviationAnalysis",
    "MissShare",
    "MissSplit",
    "PatternExample",
    "RejectionPair",
    "SliceAnalysis",
    "analyze",
    "analyze_run",
    "binned_acceptance",
    "category_table",
    "definitions",
    "miss_split",
    "pair_table",
    "slice_summary",
    "GROWTH_MIN_LOST_PER_DRAFT",
    "PATTERN_KINDS",
    "grown_patterns",
    "pattern_costs",
]
