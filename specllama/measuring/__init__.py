"""Measuring: what this machine and these models were found to do, and the choices made from it.
calibrate.py, cost_probes.py and concurrency_probes.py run the probes (verify-batch differences,
decode costs, requests side by side); fidelity.py turns differences into the verify-size limits
a fidelity level allows; records.py keeps measurements on disk with their evidence; cost_book.py
holds the costs in use; planner.py picks each request's proposer and policy from all of it;
idle.py runs what is missing while no generation runs; cores.py reads how busy the CPUs are."""
