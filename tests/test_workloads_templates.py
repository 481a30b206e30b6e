"""encode_turn / encode_request_turn on a real chat template (SmolLM2's ChatML) with an in-process tokenizer."""

from __future__ import annotations

import signal
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads import conversation
from dflash_doctor.inputs.workloads import Request, encode_request_turn, encode_turn, load_workload, read_chat_template

# SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named "
    "SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3-style switch: enable_thinking=false pre-fills an empty think block.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer(*, bos: str, add_bos: bool, chat_template: str | None) -> PreTrainedTokenizerFast:
    """A lossless byte-level tokenizer (one token per byte) with ChatML specials; optionally adds BOS itself."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIALS + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|im_end|>")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture
def smollm2():
    # SmolLM2's bos_token is <|im_start|>; let the tokenizer add it too, to catch a double BOS.
    return byte_level_tokenizer(bos="<|im_start|>", add_bos=True, chat_template=SMOLLM2_CHAT_TEMPLATE)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_chatml_renders_with_the_generation_prompt_and_a_single_bos(smollm2):
    ids = encode_turn(smollm2, [{"role": "user", "content": "What is 2+2?"}])
    assert decode(smollm2, ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == smollm2.convert_tokens_to_ids("<|im_start|>") != ids[1]


def test_bos_is_added_once_when_the_template_does_not_start_with_it():
    tokenizer = byte_level_tokenizer(bos="<|endoftext|>", add_bos=True, chat_template=SMOLLM2_CHAT_TEMPLATE)
    ids = encode_turn(tokenizer, [{"role": "user", "content": "hi"}])
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ids[0] == bos_id and ids.count(bos_id) == 1
    with_bos_in_template = "{{ bos_token }}" + SMOLLM2_CHAT_TEMPLATE
    ids = encode_turn(tokenizer, [{"role": "user", "content": "hi"}], chat_template=with_bos_in_template)
    assert ids[0] == bos_id and ids.count(bos_id) == 1


def test_raw_prompt_uses_the_tokenizers_default_special_tokens(smollm2):
    ids = encode_turn(smollm2, [], raw_prompt="def f():")
    assert decode(smollm2, ids) == "<|im_start|>def f():"


def test_second_turn_is_asked_after_the_targets_own_answer(smollm2):
    request = load_workload("mt-bench", classes=["math"], split="all")[0]
    first = decode(smollm2, encode_request_turn(smollm2, request))
    second = decode(smollm2, encode_request_turn(smollm2, request, ["f(2) = 0."]))
    q1, q2 = (m["content"] for m in request.messages)
    assert first.endswith(f"<|im_start|>user\n{q1}<|im_end|>\n<|im_start|>assistant\n") and q2 not in first
    assert second.endswith(
        f"user\n{q1}<|im_end|>\n<|im_start|>assistant\nf(2) = 0.<|im_end|>\n"
        f"<|im_start|>user\n{q2}<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="has 2 turn"):
        encode_request_turn(smollm2, request, ["a", "b"])


def test_template_kwargs_reach_the_template_and_the_caller_overrides_the_request(smollm2):
    request = Request(
        id="q", messages=({"role": "user", "content": "hi"},), chat_template_kwargs={"enable_thinking": False}
    )
    thinking_off = decode(smollm2, encode_request_turn(smollm2, request, chat_template=THINKING_TEMPLATE))
    thinking_on = decode(
        smollm2,
        encode_request_turn(
            smollm2, request, chat_template=THINKING_TEMPLATE, template_kwargs={"enable_thinking": True}
        ),
    )
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking_on.endswith("<|im_start|>assistant\n")


def test_chat_template_file_overrides_the_tokenizers_own(smollm2, tmp_path):
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}A:")
    template = read_chat_template(tmp_path / "plain.jinja")
    assert (
        decode(smollm2, encode_turn(smollm2, [{"role": "user", "content": "hi"}], chat_template=template))
        == "<|im_start|>[user] hi\nA:"
    )
    with pytest.raises(UsageError, match="--chat-template .*missing.jinja does not exist"):
        read_chat_template(tmp_path / "missing.jinja")


def test_messages_without_a_chat_template_suggest_the_fixes():
    tokenizer = byte_level_tokenizer(bos="<|endoftext|>", add_bos=False, chat_template=None)
    with pytest.raises(UsageError) as caught:
        encode_request_turn(tokenizer, Request(id="r7", messages=({"role": "user", "content": "hi"},)))
    assert caught.value.message.startswith("request r7: ")
    assert "--chat-template FILE" in caught.value.message and "`prompt`" in caught.value.message
    assert decode(tokenizer, encode_request_turn(tokenizer, Request(id="p", prompt="hello"))) == "hello"


def test_templates_render_in_a_sandbox(smollm2):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(UsageError, match="chat template could not render"):
        encode_turn(smollm2, [{"role": "user", "content": "hi"}], chat_template=escape)


def test_a_template_that_never_ends_is_stopped_with_one_sentence(smollm2, monkeypatch):
    """Nested loops of 100,000 each (the sandbox caps one range, not their nesting): 10^10 steps, stopped at the
    time limit (lowered here), and the next render runs normally: the timer and its handler are put back."""
    monkeypatch.setattr(conversation, "TEMPLATE_TIME_LIMIT_S", 0.5)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"did not finish rendering the messages within 0.5 s .*fix the template"):
        encode_turn(smollm2, [{"role": "user", "content": "hi"}], chat_template=endless)
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None) and signal.getitimer(
        signal.ITIMER_REAL
    ) == (0.0, 0.0)
    assert decode(
        smollm2, encode_turn(smollm2, [{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] }}")
    ).endswith("hi")


def test_reserved_template_kwargs_and_unfilled_placeholders_are_refused(smollm2):
    with pytest.raises(UsageError, match="add_generation_prompt"):
        encode_turn(smollm2, [{"role": "user", "content": "hi"}], template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="fill_answers"):
        encode_turn(
            smollm2, [{"role": "assistant", "content": None, "answer_of_turn": 0}, {"role": "user", "content": "q"}]
        )
