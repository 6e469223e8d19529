"""Token-level chat templating: stitched turns equal the template's rendering of the whole
conversation, so appending never changes what earlier tokens mean."""

from __future__ import annotations

import pytest

from asyncrl.envs import EnvError
from asyncrl.models.tiny import CHAT_TEMPLATE, build_tokenizer
from asyncrl.rollout.chat_tokens import TurnTemplate

QWEN_LIKE = (  # injects a default system prompt when the first message is not one (as Qwen2.5)
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' -}}{%- endif -%}" + CHAT_TEMPLATE
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, QWEN_LIKE], ids=["chatml", "qwen-like"])
def test_stitched_turns_equal_the_whole_conversation(tok, template):
    tok.chat_template = template
    tt = TurnTemplate(tok)
    eos = tok.eos_token_id
    first = [{"role": "user", "content": "hi"}]
    gen1 = enc(tok, "ab") + [eos]  # ended with EOS: the closing must not repeat it
    obs1 = [{"role": "tool", "content": "r"}]
    gen2 = enc(tok, "cd")  # cut by max_new_tokens: the closing supplies the end marker
    obs2 = [{"role": "user", "content": "u2"}]
    gen3 = enc(tok, "ef") + [eos]
    stitched = (
        tt.prompt_ids(first) + gen1 + tt.observation_ids(obs1, gen1[-1])
        + gen2 + tt.observation_ids(obs2, gen2[-1]) + gen3
    )  # fmt: skip
    conversation = [
        *first,
        {"role": "assistant", "content": "ab"}, *obs1,
        {"role": "assistant", "content": "cd"}, *obs2,
        {"role": "assistant", "content": "ef"},
    ]  # fmt: skip
    whole = tok.apply_chat_template(conversation, tokenize=False)
    assert whole.endswith("<|im_end|>\n")
    assert stitched == enc(tok, whole[: -len("\n")])  # the episode ends at the model's EOS
    if template is QWEN_LIKE:  # the default system prompt comes once, with the prompt only
        assert whole.count("You are helpful.") == 1


def test_observation_text_is_only_the_new_turn(tok):
    tok.chat_template = CHAT_TEMPLATE
    tt = TurnTemplate(tok)
    obs = [{"role": "user", "content": "lower"}]
    assert tt.observation_text(obs, ended_with_eos=True) == (
        "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tt.observation_text(obs, ended_with_eos=False).startswith("<|im_end|>\n<|im_start|>")


def test_raw_mode(tok):
    tt = TurnTemplate(tok, "none")
    assert tok.decode(tt.prompt_ids([{"role": "user", "content": "3+4="}])) == "3+4="
    obs = [{"role": "user", "content": "higher"}]
    assert tt.observation_text(obs, ended_with_eos=True) == "higher"
    assert tt.observation_text(obs, ended_with_eos=False) == "<|im_end|>higher"


def test_native_mode_needs_a_chat_template(tok):
    tok.chat_template = None
    try:
        with pytest.raises(EnvError, match="chat template"):
            TurnTemplate(tok)
    finally:
        tok.chat_template = CHAT_TEMPLATE
