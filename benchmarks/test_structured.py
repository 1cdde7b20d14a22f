"""JSON-schema extraction: constrained speculative decoding against constrained plain decoding.

    .venv/bin/python -m pytest benchmarks/test_structured.py -s

Three short documents, each extracted into one schema (greedy, 2 threads), in the same process:
- plain: the target alone under the schema, one token per pass (n_draft=0);
- forced: the target alone, proposing only the tokens the grammar forces (keys, punctuation);
- spec: the draft model, prompt lookup and forced tokens under auto control;
- free spec: speculative decoding of the same prompt with no schema (different text).
Times are whole requests (prefill included), medians of SPECLLAMA_BENCH_REPEATS; constrained
outputs must be identical to plain's. Goal (issue 19): spec at least 1.5x plain on the F16
target, and a rate at least that of free speculative decoding.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import specllama

N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
N_REPEATS = int(os.environ.get("SPECLLAMA_BENCH_REPEATS", "2"))
TARGETS = {"f16": "target-f16", "q4": "target"}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "title", "company", "city", "email", "phone", "skills"],
          "properties": {"name": {"type": "string"}, "title": {"type": "string"}, "company": {"type": "string"},
                         "city": {"type": "string"}, "email": {"type": "string"}, "phone": {"type": "string"},
                         "skills": {"type": "array", "items": {"type": "string"}}}}
DOCUMENTS = [
    "Hi all, I'm Priya Natarajan, staff engineer at Lumen Freight in Rotterdam. I mostly work on Kafka, "
    "Terraform and Go. Reach me at priya.n@lumenfreight.example or +31 10 555 0199.",
    "Signature: Tomasz Wielgus | Head of Data | Baltic Orchard Foods, Gdansk | tomasz.wielgus@bof.example | "
    "tel. +48 58 555 2210 | Spark, dbt, PostgreSQL, Airflow",
    "Our new hire, Aiyana Redcloud, joins Northwind Clinics in Denver as a mobile developer; she knows Swift, "
    "Kotlin and GraphQL. Her email is aiyana@northwind.example and her desk phone is (303) 555-0142.",
]


def messages(document: str) -> list[dict]:
    return [{"role": "user", "content": "Extract the contact as JSON with name, title, company, city, email, "
                                        "phone and skills.\n\n" + document}]


@pytest.mark.parametrize("target", list(TARGETS))
def test_json_extraction(bench_models, target):
    path = bench_models[TARGETS[target]]
    with specllama.load(path, n_ctx=2048, n_threads=N_THREADS, idle_work=False) as alone, \
            specllama.load(path, bench_models["draft"], n_ctx=2048, n_threads=N_THREADS, idle_work=False) as pair:
        for llm in (alone, pair):  # first-use measurements, untimed
            llm.warm_up()
            llm.chat(messages(DOCUMENTS[0]), max_tokens=8, json_schema=SCHEMA)
        times: dict[str, list[float]] = {"plain": [], "forced": [], "spec": [], "free spec": []}
        rates: dict[str, list[float]] = {name: [] for name in times}
        last = {}
        for _ in range(N_REPEATS):
            for document in DOCUMENTS:
                tokens = pair.chat_tokens(messages(document))
                runs = {"plain": alone.generate(tokens, max_tokens=160, json_schema=SCHEMA, n_draft=0),
                        "forced": alone.generate(tokens, max_tokens=160, json_schema=SCHEMA),
                        "spec": pair.generate(tokens, max_tokens=160, json_schema=SCHEMA),
                        "free spec": pair.generate(tokens, max_tokens=160)}
                for name, r in runs.items():
                    times[name].append(r.stats.t_total)
                    rates[name].append(r.stats.n_generated / r.stats.t_total)
                    last[name] = r
                for name in ("forced", "spec"):  # the same output, but at a counted near-tie
                    first = next((i for i, (a, b) in enumerate(zip(runs[name].tokens, runs["plain"].tokens))
                                  if a != b), None)
                    assert first is None or first in runs[name].stats.near_tie_positions, (name, first)
        ratio = {name: float(np.median(np.array(times["plain"]) / np.array(times[name]))) for name in times}
        rate = {name: float(np.median(rates[name])) for name in rates}
        spec = last["spec"].stats
        row = {"target": target, "speedup forced": ratio["forced"], "speedup spec": ratio["spec"],
               **{f"tokens/s {name}": round(rate[name], 2) for name in rates},
               "spec rate / free spec rate": rate["spec"] / rate["free spec"],
               "grammar rounds": spec.n_grammar_rounds, "forced accepted": spec.n_forced_accepted,
               "constraint ms/row": 1e3 * spec.t_constraint / max(1, spec.n_constrained_rows),
               "spec summary": spec.summary(), "spec text": last["spec"].text}
        print(json.dumps(row, indent=1))
