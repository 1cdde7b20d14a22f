"""Scheduling: requests side by side on one pair of models. slots.py hands out slots and the
models' turn (who may touch a model now); sharing.py gives concurrent requests lanes of one
context whose rows ride in one pass; batch.py runs a list of prompts together. docs/threads.md
maps every thread and every lock."""
