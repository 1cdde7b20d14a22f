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

# the 4-turn chat benchmark's conversation (test_chat.py): Python's shlex.py (about 2,900 tokens
# with a chat template) and four questions about it
CHAT_QUESTIONS = [
    "Explain in a few sentences what shlex.split does with posix=True versus posix=False.",
    "Write a small function that uses shlex to split a command line and reports unbalanced quotes.",
    "How does shlex.quote decide whether a string needs quoting? Show an example.",
    "Suggest two unit tests for the punctuation_chars option.",
]


def shlex_source() -> str:
    import inspect
    import shlex

    return inspect.getsource(shlex)


# the controller at 2,000-4,000 tokens of KV (issue 29): the chat's file and second question in one
# turn; not in test_speedup's table, whose n_ctx is 2048
LONG_WORKLOADS = {"long": "Answer questions about this file:\n\n```python\n" + shlex_source() + "```\n\n"
                  + CHAT_QUESTIONS[1]}
