"""The out dir's README.md: what the trained draft is, how it was trained and how well it drafts.

The kind's own lines (title, usage, architecture) and words (what one step proposes, the held-out K) come
from its :class:`~dflash_doctor.models.training.recipes.TrainingRecipe`; the rest is the same for every kind.
"""

from __future__ import annotations

from typing import Any

from dflash_doctor.models.training.recipes import TrainingRecipe

SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 48) -> str:
    """The loss curve as one line of block characters (the card stays plain text)."""
    if not values:
        return ""
    stride = max(1, len(values) // width)
    points = values[::stride]
    low, high = min(points), max(points)
    span = (high - low) or 1.0
    return "".join(SPARK_LEVELS[int((v - low) / span * (len(SPARK_LEVELS) - 1))] for v in points)


def model_card(facts: dict[str, Any], recipe: TrainingRecipe) -> str:
    """README.md from the training log's ``facts`` (training_log.json holds the same)."""
    arch, train, data, log = facts["architecture"], facts["train_config"], facts["data"], facts["log"]
    lines = [
        *recipe.card_head(facts),
        "",
        "## Data",
        "",
        f"- workload `{data['workload']}` (train split for built-in sets) + {data.get('extra_word_problems', 0)} extra "
        f"GSM-style problems (train templates) + {data.get('self_written_prompts', 0)} prompts written by the target: "
        f"{data['num_requests']} requests, {data['num_sequences']} sequences (one per turn and answer), "
        f"{data['num_response_tokens']} response tokens",
        f"- answers per prompt: the greedy one + {data.get('samples_per_prompt', 0)} sampled at temperature "
        f"{data.get('sample_temperature', 0.8)}",
        f"- responses: {data['responses']}, at most {data['max_new_tokens']} new tokens",
        f"- this run's wall time: data {facts['seconds']['data']:.0f} s (generated, or read from the cache), held-out "
        f"before training + training {facts['seconds']['initial_eval_and_train']:.0f} s, held-out after "
        f"{facts['seconds']['final_eval']:.0f} s",
        f"- chat template sha256 `{facts['chat_template_sha256']}` (full text in config.json `dflash_doctor`)",
        "",
        "## Hyper-parameters",
        "",
        "| parameter | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in train.items()],
        "",
        "## Loss curve",
        "",
        *(
            [
                f"Stopped by --time-limit at step {facts['final_step']} "
                f"of {train['steps']}: the same command goes on from "
                "the checkpoint.",
                "",
            ]
            if facts["final_step"] < train["steps"]
            else []
        ),
        f"`{sparkline([row['loss'] for row in log])}`",
        "",
        f"| step | loss | accepted per {recipe.card_unit} | lr |",
        "|---|---|---|---|",
    ]
    stride = max(1, len(log) // 10)
    for row in log[::stride] + ([log[-1]] if log and (len(log) - 1) % stride else []):
        lines.append(f"| {row['step']} | {row['loss']:.4f} | {row['accepted_per_block']:.2f} | {row['lr']:.2e} |")
    lines += ["", f"## Held-out acceptance (temperature 0, {recipe.card_k(arch)})", ""]
    evaluation = facts.get("evaluation")
    if not evaluation:
        lines.append("Not measured (a user workload file has no held-out split, or --eval-requests 0).")
    else:
        lines += [
            f"Mean acceptance length tau (bonus included) on {evaluation['num_requests']} requests of the "
            f"`{data['workload']}` eval split, with 95% bootstrap intervals over requests: the live loop's schedule at "
            f"T = 0 walked with batched {recipe.card_walk} (identical to the live loop on the target's greedy "
            "continuations).",
            "",
            "| class | requests | tau (trained) | 95% CI | tau (before training) |",
            "|---|---|---|---|---|",
        ]
        for name, row in evaluation["trained"].items():
            lo, hi = row["tau_ci"]
            before = evaluation["initial"][name]["tau"]
            lines.append(f"| {name} | {row['num_requests']} | {row['tau']:.2f} | [{lo:.2f}, {hi:.2f}] | {before:.2f} |")
    return "\n".join(lines) + "\n"
