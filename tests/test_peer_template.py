"""bench agents' llama-server template: the checkpoint's own, a later system message rendered as a user turn."""
from deltaserve.bench.clis.peer_template import patched, write_peer_template
from deltaserve.text.tokenizer import load_tokenizer

# the message loop of Qwen3.5's template, as shipped (abridged to the branches that matter here)
QWEN35_LOOP = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}"""


def test_a_later_system_message_renders_as_a_user_turn(tmp_path):
    tok = load_tokenizer(None)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "system", "content": "env"}, {"role": "user", "content": "u2"}]
    try:
        tok.apply_chat_template(msgs, chat_template=QWEN35_LOOP, add_generation_prompt=False)
        raise AssertionError("the template as shipped should refuse")
    except Exception as e:
        assert "System message must be at the beginning" in str(e)
    fixed = patched(QWEN35_LOOP)
    text = tok.apply_chat_template(msgs, chat_template=fixed, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu1<|im_end|>\n"
                    "<|im_start|>user\nenv<|im_end|>\n<|im_start|>user\nu2<|im_end|>\n")
    # a conversation without a later system message renders exactly as before
    assert tok.apply_chat_template(msgs[:2], chat_template=fixed, add_generation_prompt=False) == \
        tok.apply_chat_template(msgs[:2], chat_template=QWEN35_LOOP, add_generation_prompt=False)
    (tmp_path / "chat_template.jinja").write_text(QWEN35_LOOP)
    assert write_peer_template(str(tmp_path), tmp_path).read_text() == fixed


def test_a_template_without_the_refusal_is_used_as_it_is(tmp_path):
    assert patched("{{ messages[0].content }}") is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    assert write_peer_template(str(tmp_path), tmp_path) is None
    assert write_peer_template(str(tmp_path / "missing"), tmp_path) is None
