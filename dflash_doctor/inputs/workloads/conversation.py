"""Multi-turn conversations and their rendering: :func:`conversation_turns` gives one message list per turn
with placeholders for the answers, :func:`fill_answers` puts the target's answers in, :func:`encode_turn` /
:func:`encode_request_turn` render and tokenise one turn with the model's own chat template (sandboxed
Jinja, as transformers renders it).

Its own module because it needs a tokenizer and a template, where the rest of the package reads files.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads.request import Request, count_trailing_user_messages


ANSWER_OF_TURN = "answer_of_turn"  # key marking an assistant placeholder in conversation_turns()


# apply_chat_template arguments that a template kwarg must not override: they fix how we render.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "chat_template", "add_generation_prompt", "continue_final_message",
                                       "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs"})


#: Seconds one chat-template render may take. Real templates render a conversation in milliseconds; a template
#: whose loops never end (the sandbox caps each range at 100,000 items, not their nesting) would hang the command.
TEMPLATE_TIME_LIMIT_S = 10.0


class _TemplateTimeout(Exception):
    """Raised inside a render that ran past :data:`TEMPLATE_TIME_LIMIT_S`."""


@contextmanager
def _render_time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with :class:`_TemplateTimeout`: a real-time timer signal, which
    Python delivers between bytecodes, so a Jinja loop stops where it is. Only the main thread can take a
    signal; elsewhere (a dashboard session's thread) and where the platform has no timer the block runs
    unlimited."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_signum, _frame):
        raise _TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def conversation_turns(request: Request) -> list[list[dict[str, Any]]]:
    """One message list per turn to answer: everything up to and including that turn's user message.

    The answers to earlier turns are placeholders ``{"role": "assistant", "content": None,
    "answer_of_turn": i}`` because replay puts the target's OWN answer there (fill them with
    :func:`fill_answers`). MT-Bench ``[q1, q2]`` gives ``[[q1], [q1, <answer 0>, q2]]``; a conversation
    that ends with a tool result is one turn. A raw ``prompt`` request has no messages: encode it with
    ``encode_turn(..., raw_prompt=request.prompt)`` (or use :func:`encode_request_turn`).
    """
    if request.messages is None:
        raise ValueError(f"request {request.id} is a raw prompt; encode request.prompt with raw_prompt")
    messages = [dict(m) for m in request.messages]
    num_followups = count_trailing_user_messages(messages)
    if num_followups == 0:
        return [messages]
    history = messages[: len(messages) - num_followups]
    turns = []
    for turn, user_message in enumerate(messages[len(messages) - num_followups:]):
        if turn:
            history.append({"role": "assistant", "content": None, ANSWER_OF_TURN: turn - 1})
        history.append(user_message)
        turns.append([dict(m) for m in history])
    return turns


def fill_answers(messages: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[dict[str, Any]]:
    """Replace the answer placeholders of one turn with the target's answers (``answers[i]`` answers turn i)."""
    filled = []
    for message in messages:
        if ANSWER_OF_TURN in message:
            turn = message[ANSWER_OF_TURN]
            if turn >= len(answers):
                raise ValueError(f"turn {turn} has no answer yet: ask the turns in order")
            message = {"role": "assistant", "content": answers[turn]}
        filled.append(dict(message))
    return filled


def read_chat_template(path: Path | str) -> str:
    """The text of a ``--chat-template FILE`` (a Jinja template that overrides the tokenizer's own)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--chat-template {path} does not exist; pass an existing Jinja template file.")
    return path.read_text(encoding="utf-8")


def encode_turn(tokenizer: Any, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None, raw_prompt: str | None = None) -> list[int]:
    """Token ids of one prompt, as a serving engine would build them.

    Messages render with the tokenizer's own chat template (or ``chat_template``, the TEXT of a
    ``--chat-template`` file) through ``apply_chat_template``, which uses a sandboxed Jinja
    environment, with ``add_generation_prompt=True``; ``template_kwargs`` (e.g. ``enable_thinking``)
    reach the template. When the rendered text already starts with the BOS token the text is
    tokenised without special tokens, so BOS is never doubled (llama.cpp PR #4025, transformers
    #31099). ``raw_prompt`` skips the template and uses the tokenizer's default special tokens.
    """
    if raw_prompt is not None:
        return list(tokenizer(raw_prompt)["input_ids"])
    if any(ANSWER_OF_TURN in m for m in messages):
        raise ValueError("messages still hold answer placeholders: pass them through fill_answers first")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or '(in memory)'} has no chat template; "
                         "pass --chat-template FILE or give the requests a `prompt` field instead of `messages`.")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise UsageError(f"chat_template_kwargs {', '.join(reserved)} would change how dflash-doctor renders prompts; remove them.")
    import jinja2  # transformers' own template dependency; only its exception type is needed here

    try:
        with _render_time_limit(TEMPLATE_TIME_LIMIT_S):
            text = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                                 tokenize=False, **kwargs)
    except jinja2.TemplateError as exc:
        raise UsageError(f"the chat template could not render the messages ({exc}); fix the messages or pass --chat-template FILE.") from None
    except _TemplateTimeout:
        raise UsageError(f"the chat template did not finish rendering the messages within {TEMPLATE_TIME_LIMIT_S:g} s "
                         "(a loop that does not end?); fix the template or pass --chat-template FILE.") from None
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


def encode_request_turn(tokenizer: Any, request: Request, answers: Sequence[str] = (), *, chat_template: str | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids for turn ``len(answers)`` of ``request``, given the target's answers to the earlier turns.

    ``template_kwargs`` from the caller (e.g. a check forcing ``enable_thinking``) override the
    request's own ``chat_template_kwargs``.
    """
    if len(answers) >= request.num_turns:
        raise ValueError(f"request {request.id} has {request.num_turns} turn(s); got {len(answers)} answers")
    try:
        if request.messages is None:
            return encode_turn(tokenizer, [], raw_prompt=request.prompt)
        messages = fill_answers(conversation_turns(request)[len(answers)], answers)
        return encode_turn(tokenizer, messages, chat_template=chat_template,
                           template_kwargs={**request.chat_template_kwargs, **(template_kwargs or {})})
    except UsageError as exc:
        raise UsageError(f"request {request.id}: {exc.message}") from None
