"""Prompts shared by the end-to-end tests and the benchmarks."""

CODE = "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n"
PROSE = "The history of the lighthouse on the northern cape begins in 1843, when"
JSON = ('Extract the fields as JSON with keys name, age, city.\n'
        'Text: "Maria Gonzalez, 34, moved to Lisbon last spring."\nJSON: {"name": "')
LIST = "Days of the week:\n1. Monday\n2. Tuesday\n3."
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
RAW = "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"
