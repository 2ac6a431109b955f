"""How the HTTP door builds a chat prompt from what an OpenAI client sends: a message's `name`, content in text parts.
Against a real local cluster (scripts/up.py), a real door process and real HTTP (httpx); the prompt's token count
(`usage.prompt_tokens`) shows which text was tokenized."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.cluster_helpers import local_cluster
from tests.test_http import front_door, key

# A template that names participants, as some models' do.
NAMING = ("{% for m in messages %}<|bos|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}\n{{ m.content }}"
          "<|eos|>{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-prompts"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


def prompt_tokens(base: str, c: dict, messages: list[dict]) -> int:
    r = httpx.post(base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=120,
                   headers={"Authorization": f"Bearer {key(c, 'api-co')}"})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


PARTS = [{"role": "user", "content": [{"type": "text", "text": "alpha beta"}, {"type": "text", "text": "gamma"}]}]
NAMED = [{"role": "user", "name": "ann", "content": "alpha beta"}]


def test_a_template_reads_a_message_s_name_and_its_parts_joined_by_newlines(cluster, tiny_model_dir, tmp_path):
    """The `name` was dropped before the template saw it, and text parts were joined with "" (vLLM passes the name
    to the template and joins parts with a newline): a conversation of named participants lost who said what, and
    "alpha beta" + "gamma" became "alpha betagamma"."""
    from transformers import AutoTokenizer

    templated = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, templated)
    tok = AutoTokenizer.from_pretrained(templated)
    tok.chat_template = NAMING
    tok.save_pretrained(templated)

    def count(messages: list[dict]) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False).input_ids)

    joined = [{"role": "user", "content": "alpha beta\ngamma"}]
    assert count(joined) != count([{"role": "user", "content": "alpha betagamma"}])
    assert count(NAMED) != count([{"role": "user", "content": "alpha beta"}])
    with front_door(templated, [cluster["gateway"]], tmp_path / "door.log") as base:
        assert prompt_tokens(base, cluster, PARTS) == count(joined)
        assert prompt_tokens(base, cluster, NAMED) == count(NAMED)


def test_the_plain_format_names_the_speaker_and_joins_parts_by_newlines(cluster, tiny_model_dir):
    """A tokenizer without a chat template: `user (ann): ...`, not `user: ...` with the name dropped."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not tok.chat_template

    def count(text: str) -> int:
        return len(tok(text).input_ids)

    assert count("user (ann): alpha beta\nassistant:") != count("user: alpha beta\nassistant:")
    assert prompt_tokens(cluster["http"], cluster, NAMED) == count("user (ann): alpha beta\nassistant:")
    assert count("user: alpha beta\ngamma\nassistant:") != count("user: alpha betagamma\nassistant:")
    assert prompt_tokens(cluster["http"], cluster, PARTS) == count("user: alpha beta\ngamma\nassistant:")
