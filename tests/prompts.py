"""Prompts shared by the end-to-end tests and the benchmarks."""

CODE = "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n"
PROSE = "The history of the lighthouse on the northern cape begins in 1843, when"
JSON = ('Extract the fields as JSON with keys name, age, city.\n'
        'Text: "Maria Gonzalez, 34, moved to Lisbon last spring."\nJSON: {"name": "')
LIST = "Days of the week:\n1. Monday\n2. Tuesday\n3."
# Prompts whose continuation must copy the prompt, so prompt lookup finds matches whatever
# text this CPU's kernels generate (a list's continuation need not repeat any n-gram).
EDIT = [{"role": "user", "content": "Rename the parameter `n` to `count` and return the whole function, nothing "
         "else:\n```python\ndef total(n):\n    result = 0\n    for i in range(n):\n        result += i * i\n"
         "    return result\n```"}]
COPY = ("Repeat the sentence exactly.\nSentence: The quick brown fox jumps over the lazy dog near the river bank.\n"
        "Repeat: The")
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
RAW = "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"

# Over 400 tokens, so 300 generated tokens run past KV lengths 512 and 768, where llama.cpp's
# single-token attention takes another kernel path than verify batches do.
LONG_STORY = (
    "The keeper's log of the northern cape light, kept from the autumn of 1843 until the storm of 1851, "
    "is a plain book bound in sailcloth. Its first entries are short: the state of the wick, the oil burned, "
    "the ships that passed and the weather at each watch. Over the years the entries grow longer. The keeper, "
    "a former ship's carpenter named Elias Brandt, begins to record the birds that strike the lantern glass "
    "on foggy nights, the seals on the skerries below the tower, and the letters he writes to his sister in "
    "the town across the bay. He notes that the fog comes in from the west in late summer and from the north "
    "in winter, that the oil thickens in the cold and must be warmed before it will climb the wick, and that "
    "the fishermen trust the light more than their own compasses. In the spring of 1847 a supply boat fails "
    "to arrive for nine weeks. Brandt rations the oil, dims the lamp on clear nights and keeps it full in fog, "
    "and writes each evening how many days of oil remain. He fishes from the rocks, salts what he cannot eat, "
    "and mends the boat shed with timber washed up from a wreck. When the boat finally comes, its master "
    "tells him that the company had thought the station abandoned. Brandt's entry that night is a single "
    "line: the light has not missed a night. The later pages describe the building of a new stone jetty, a "
    "visit from an inspector who measures the lantern's beam with a brass instrument, and the arrival of an "
    "assistant keeper, a boy of fifteen from the town, whom Brandt teaches to trim the wick, read the "
    "barometer and keep the log in a fair hand. The boy's first entries sit beside the old man's, and the two "
    "hands alternate for almost three years. Then, in the autumn of 1851, the entries stop in the middle of a "
    "sentence about the rising sea. What follows is the account of what the townspeople found when the storm "
    "had passed and the first boat reached the cape.\n\n"
)
LONG_CODE = '''import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Reading:
    station: str
    day: str
    temperature: float
    rainfall: float
    wind_speed: float


@dataclass
class StationSummary:
    station: str
    days: int = 0
    temperatures: list = field(default_factory=list)
    rainfall_total: float = 0.0
    windiest_day: str = ""
    windiest_speed: float = 0.0

    def add(self, reading):
        self.days += 1
        self.temperatures.append(reading.temperature)
        self.rainfall_total += reading.rainfall
        if reading.wind_speed > self.windiest_speed:
            self.windiest_speed = reading.wind_speed
            self.windiest_day = reading.day

    @property
    def mean_temperature(self):
        return statistics.fmean(self.temperatures) if self.temperatures else float("nan")


def read_readings(path):
    """Read weather readings from a CSV file with a header row."""
    readings = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            readings.append(Reading(
                station=row["station"],
                day=row["day"],
                temperature=float(row["temperature"]),
                rainfall=float(row["rainfall"]),
                wind_speed=float(row["wind_speed"]),
            ))
    return readings


def summarize(readings):
    """Group readings by station and summarize each station."""
    summaries = {}
    for reading in readings:
        summary = summaries.setdefault(reading.station, StationSummary(reading.station))
        summary.add(reading)
    return summaries


def write_report(summaries, path):
    """Write one line per station, sorted by station name."""
    with Path(path).open("w") as f:
        for name in sorted(summaries):
            s = summaries[name]
            f.write(f"{name}: {s.days} days, mean {s.mean_temperature:.1f} C, "
                    f"rain {s.rainfall_total:.1f} mm, windiest {s.windiest_day}\\n")


def wettest_stations(summaries, n=3):
    """Return the names of the n stations with the most rain, wettest first."""
'''
# The same story as a chat request: on our CPU the previous single exact-mode limit made
# speculative greedy output differ from plain decoding at generated token 25 of this one.
LONG_CHAT = [{"role": "user", "content": LONG_STORY + "Continue the story in the same style."}]
