"""Benchmark workloads: chat prompts whose answers range from predictable to open."""

EDIT_SOURCE = '''def summarize(records):
    totals = {}
    counts = {}
    for record in records:
        key = record["region"]
        totals[key] = totals.get(key, 0) + record["amount"]
        counts[key] = counts.get(key, 0) + 1
    result = []
    for key in sorted(totals):
        average = totals[key] / counts[key]
        result.append({"region": key, "total": totals[key], "average": average})
    return result


def top_regions(records, n=3):
    summary = summarize(records)
    summary.sort(key=lambda item: item["total"], reverse=True)
    return [item["region"] for item in summary[:n]]
'''

WORKLOADS = {
    "code": "Write a Python class implementing a binary search tree with insert, search and delete "
            "methods, with docstrings.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "edit": "Rewrite this code, renaming the parameter `records` to `rows` everywhere. Output only the "
            "code.\n\n```python\n" + EDIT_SOURCE + "```",
    "json": "Extract every person as a JSON list of objects with keys name, age, city, job.\n\n"
            "Maria Gonzalez, 34, is a nurse in Lisbon. Her brother Tomas, 29, drives trams in Porto. "
            "Their friend Aiko Tanaka, 41, teaches physics in Osaka, and Aiko's neighbour Lars Berg, "
            "52, repairs boats in Bergen.",
}

# a long context: the 4-turn chat benchmark's system prompt (Python's shlex.py, about 2,900
# tokens) and its second question, for the controller at 2,000-4,000 tokens of KV (issue 29)
LONG_QUESTION = "Write a small function that uses shlex to split a command line and reports unbalanced quotes."


def long_chat() -> str:
    import inspect
    import shlex

    return "Answer questions about this file:\n\n```python\n" + inspect.getsource(shlex) + "```\n\n" + LONG_QUESTION


LONG_WORKLOADS = {"long": long_chat()}  # not in test_speedup's table: its n_ctx is 2048

