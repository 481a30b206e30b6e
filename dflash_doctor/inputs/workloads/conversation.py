"""Multi-turn conversations and their rendering: :func:`conversation_turns` gives one message list per turn
with placeholders for the answers, :func:`fill_answers` puts the target's answers in, :func:`encode_turn` /
:func:`encode_request_turn` render and tokenise one turn with the model's own chat template (sandboxed
Jinja, as transformers renders it).

Its own module because it needs a tokenizer and a template, where the rest of the package reads files.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads.request import Request, count_trailing_user_messages


ANSWER_OF_TURN = "answer_of_turn"  # key marking an assistant placeholder in conversation_turns()


# apply_chat_template arguments that a template kwarg must not override: they fix how we render.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
    }
)


#: Seconds one chat-template render may take. Real templates render a conversation in milliseconds; a template
#: whose loops never end (the sandbox caps each range at 100,000 items, not their nesting) would hang the command.
TEMPLATE_TIME_LIMIT_S = 10.0

#: The most characters (or items) a chat template may build in one string or list, the widest number it may
#: pass to a function or filter, and the longest prompt it may render: 2**24 (16.8 M) characters, about 4 M
#: tokens, above the context of any model this tool replays. The time limit cannot stop one C-level operation,
#: so ``'x' * 10**12`` would ask for 1 TB at once: :class:`BoundedSandbox` checks the size before the operation.
MAX_TEMPLATE_SIZE = 1 << 24

#: a run of digits in a format string (``'%1000000000d'``, ``'{:>1000000000}'``): a width or a precision
_FORMAT_NUMBER = re.compile(r"[0-9]+")


def _bound(size: int, what: str) -> None:
    """Refuse, inside the render, an operation that would build more than :data:`MAX_TEMPLATE_SIZE` items."""
    if size > MAX_TEMPLATE_SIZE:
        raise SecurityError(f"{what} asks for {size:,} items, above the chat template limit of {MAX_TEMPLATE_SIZE:,}")


def _bound_arguments(args: Sequence[Any], kwargs: dict[str, Any], what: str) -> None:
    """Every number a template passes to a call or filter is a size at most (a width, a count, an indent)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int):
            _bound(abs(value), what)


def _bound_format(text: str, what: str) -> None:
    """A format string's widths and precisions are sizes of the text it builds."""
    for digits in _FORMAT_NUMBER.findall(text):
        _bound(int(digits) if len(digits) < 20 else MAX_TEMPLATE_SIZE + 1, what)


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with ``a ~ b`` (no operator method to intercept) joined through
    :meth:`BoundedSandbox.bounded_concat`, so a loop doubling a string by ``~`` stops at the size limit."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.bounded_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox (immutable builtins, no private attributes) that also bounds the
    operators and calls which build large values in one step: repetition and concatenation (``*``, ``+``),
    powers (``**``), ``%`` formatting, and the numbers and format strings handed to functions, methods and
    filters. :func:`bounded_chat_templates` makes transformers compile chat templates with it. What no single
    step can reach (a loop doubling a string) meets the render's time limit or the rendered-size limit."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals.pop("lipsum", None)  # paragraphs of placeholder text: no chat template's business, and a size

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple)
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(times, int):
                    _bound(len(seq) * times, "a repetition (*)")
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            _bound(len(left) + len(right), "a concatenation (+)")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _bound(abs(left).bit_length() * right // 8, "a power (**), in bytes,")
        elif operator == "%" and isinstance(left, str):
            _bound_format(left, "a % format")
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def bounded_concat(text: str) -> str:
        """The result of a ``~`` joined (jinja2 joins the pieces first; one such join is at most twice the
        limit, and the next one stops)."""
        _bound(len(text), "a concatenation (~)")
        return text

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _bound_arguments(args, kwargs, f"a call of {getattr(obj, '__name__', 'a function')}")
        # jinja2 hands str.format out wrapped (its own format checks): the string is the wrapped method's owner
        owner, name = getattr(getattr(obj, "__wrapped__", obj), "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, str) and name in ("format", "format_map"):
            _bound_format(owner, "a format string")
        if isinstance(owner, str) and name == "replace" and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            _bound(len(owner) + (owner.count(old) if old else len(owner) + 1) * len(new), "a replace")
        return super().call(context, obj, *args, **kwargs)

    def from_string(self, source: Any, *args: Any, **kwargs: Any) -> Any:
        """Compile with every filter bounded like a call (filters are looked up when a template compiles)."""
        for name, function in list(self.filters.items()):
            if not getattr(function, "bounded", False):
                self.filters[name] = _bounded_filter(name, function)
        return super().from_string(source, *args, **kwargs)


def _bounded_filter(name: str, function: Any) -> Any:
    """``function`` with its numbers and format strings bounded; jinja2's pass-context markers are kept."""

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _bound_arguments(args, kwargs, f"the filter {name}")
        if name == "format" and args and isinstance(args[0], str):
            _bound_format(args[0], "the filter format")
        if name == "join" and len(args) > 1 and isinstance(args[1], (list, tuple)):  # args[0]: jinja2's eval context
            _bound(sum(len(piece) for piece in args[1] if isinstance(piece, str)), "the filter join")
        if name == "indent" and args and isinstance(args[0], str):  # the indent is repeated on every line
            num_lines = args[0].count("\n") + 1
            width = kwargs.get("width", args[1] if len(args) > 1 else 4)
            _bound(num_lines * (width if isinstance(width, int) else len(str(width))), "the filter indent")
        return function(*args, **kwargs)

    bounded.bounded = True  # type: ignore[attr-defined]
    return bounded


@functools.cache
def bounded_chat_templates() -> None:
    """Make transformers compile chat templates in :class:`BoundedSandbox`: it builds its sandbox from the name
    ``ImmutableSandboxedEnvironment`` of its own module, with its own globals and filters (which stay its
    own), and caches compiled templates, so the cache is emptied once when the class is swapped. Done once,
    before the first render this tool asks for."""
    from transformers.utils import chat_template_utils

    # a name the module imported from jinja2, not one it exports: set as the attribute it is
    setattr(chat_template_utils, "ImmutableSandboxedEnvironment", BoundedSandbox)
    chat_template_utils._compile_jinja_template.cache_clear()


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
    for turn, user_message in enumerate(messages[len(messages) - num_followups :]):
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


def encode_turn(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    raw_prompt: str | None = None,
) -> list[int]:
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
        raise UsageError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or '(in memory)'} has no chat template; "
            "pass --chat-template FILE or give the requests a `prompt` field instead of `messages`."
        )
    kwargs = dict(template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise UsageError(
            f"chat_template_kwargs {', '.join(reserved)} would change how dflash-doctor renders prompts; remove them."
        )
    bounded_chat_templates()
    try:
        with _render_time_limit(TEMPLATE_TIME_LIMIT_S):
            text = tokenizer.apply_chat_template(
                messages, chat_template=chat_template, add_generation_prompt=True, tokenize=False, **kwargs
            )
    except (jinja2.TemplateError, ArithmeticError, MemoryError) as exc:
        # ArithmeticError: jinja2's range() above 100,000 items is an OverflowError, 1/0 a ZeroDivisionError
        raise UsageError(
            f"the chat template could not render the messages ({type(exc).__name__}: {exc}); "
            "fix the template or the messages, or pass --chat-template FILE."
        ) from None
    except _TemplateTimeout:
        raise UsageError(
            f"the chat template did not finish rendering the messages within {TEMPLATE_TIME_LIMIT_S:g} s "
            "(a loop that does not end?); fix the template or pass --chat-template FILE."
        ) from None
    if len(text) > MAX_TEMPLATE_SIZE:
        raise UsageError(
            f"the chat template rendered {len(text):,} characters, above the limit of {MAX_TEMPLATE_SIZE:,} "
            "(longer than any context window); fix the template or pass --chat-template FILE."
        )
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


def encode_request_turn(
    tokenizer: Any,
    request: Request,
    answers: Sequence[str] = (),
    *,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
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
        return encode_turn(
            tokenizer,
            messages,
            chat_template=chat_template,
            template_kwargs={**request.chat_template_kwargs, **(template_kwargs or {})},
        )
    except UsageError as exc:
        raise UsageError(f"request {request.id}: {exc.message}") from None
