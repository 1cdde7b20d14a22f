"""A long prompt's prefill shows how far it has come: generate()'s on_progress, and llama-server's
return_progress on the OpenAI chat, completions and Responses streams, read by the openai SDK.

The tiny random-weight model (Qwen's vocabulary and chat template) prefills a prompt of three
batches in a moment: what is tested is what is reported, which no model's quality changes."""

from __future__ import annotations

import math
from typing import Optional

import openai
import pytest

import specllama
from conftest import SETTINGS
from serving import serve

LONG = "Tell me about the sea and the ships on it. " * 110  # about 1,100 tokens: three batches of 512
GREEDY = {"temperature": 0, "max_tokens": 4}


def check_progress(events: list[dict], n_batch: int) -> None:
    """Where the prefill starts (what a cache held), each batch, the whole prompt; nothing else."""
    total, cache = events[0]["total"], events[0]["cache"]
    assert events[0]["processed"] == cache and events[-1]["processed"] == total, events
    assert all(e["total"] == total and e["cache"] == cache for e in events), events
    processed = [e["processed"] for e in events]
    assert processed == sorted(set(processed)), events  # each batch once, in order
    assert len(events) == 1 + math.ceil((total - cache) / n_batch), events
    times = [e["time_ms"] for e in events]
    assert times == sorted(times) and times[-1] > 0


def test_on_progress_reports_each_batch_and_changes_no_token(tiny_paths):
    with specllama.load(tiny_paths["attention-draft"], draft=None, idle_work=False, **SETTINGS) as llm:
        events: list = []
        first = llm.generate(LONG, on_progress=events.append, **GREEDY)
        check_progress([e.as_dict() for e in events], llm.target.n_batch)
        assert events[0].cache == 0 and events[-1].total == first.stats.n_prompt > 2 * llm.target.n_batch
        # the prompt again and a little more: the cache held all but the end
        more: list = []
        again = llm.generate(LONG + "And the fish?", on_progress=more.append, **GREEDY)
        check_progress([e.as_dict() for e in more], llm.target.n_batch)
        assert more[0].cache == again.stats.n_prompt_cached > 0 and len(more) == 2
        plain = llm.generate(LONG, **GREEDY)
        assert plain.tokens == first.tokens
        with pytest.raises(specllama.InvalidParameterError, match="on_progress"):
            llm.generate("hi", on_progress="a bar")
        assert llm.generate("hi", **GREEDY).finish_reason in ("stop", "length")  # it still works


@pytest.fixture(scope="module")
def oai(tiny_paths, tmp_path_factory):
    log = tmp_path_factory.mktemp("progress") / "serve.log"
    with serve(tiny_paths["attention-draft"], log, "--draft", "none") as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def extra(event) -> Optional[dict]:
    return (event.model_extra or {}).get("prompt_progress")


def text_of(chunk) -> str:
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    return (choice.delta.content if hasattr(choice, "delta") else choice.text) or ""


@pytest.mark.children
def test_chat_and_completions_streams_send_prompt_progress_before_the_text(oai):
    for create, kwargs in ((oai.chat.completions.create, {"messages": [{"role": "user", "content": LONG}]}),
                           (oai.completions.create, {"prompt": LONG})):
        events, texts, n_prompt = [], [], None
        for chunk in create(model="m", stream=True, stream_options={"include_usage": True},
                            extra_body={"return_progress": True}, **kwargs, **GREEDY):
            text = text_of(chunk)
            if extra(chunk) is not None:
                assert not texts and not text, "progress after the text began"
                events.append(extra(chunk))
            elif chunk.usage is not None:
                n_prompt = chunk.usage.prompt_tokens
            elif text:
                texts.append(text)
        check_progress(events, 512)
        assert events[-1]["total"] == n_prompt and texts, (create, events)
        assert events[0]["cache"] < 512 and len(events) >= 3, events  # a prompt new to the server
        # not asked for: no progress
        quiet = create(model="m", stream=True, **kwargs, **GREEDY)
        assert not any(extra(chunk) is not None for chunk in quiet)


@pytest.mark.children
def test_responses_stream_sends_prompt_progress_in_in_progress_events(oai):
    events, kinds = [], []
    for event in oai.responses.create(model="m", input="Rivers now. " + LONG, stream=True, max_output_tokens=4,
                                      temperature=0, extra_body={"return_progress": True}):
        kinds.append(event.type)
        if extra(event) is not None:
            assert event.type == "response.in_progress"
            events.append(extra(event))
    check_progress(events, 512)
    assert events[0]["cache"] < 512 and len(events) >= 3, events  # a prompt new to the server
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # at max_output_tokens
    assert kinds.index("response.output_item.added") > 1 + len(events)  # every one before the output
