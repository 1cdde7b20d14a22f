"""Decoding: the speculative loop and the pure parts it calls. decode.py runs a generation's
rounds (propose, verify in one pass, accept, roll back); proposers.py drafts chains or trees
from a draft model or the prompt; verify.py holds the acceptance rules in the paper's notation;
sampling.py and constraints.py turn a row of logits into the distribution a token is drawn
from; tree.py, proposals.py, stats.py and limits.py are the values and sizes they share. Nothing
here imports llama_cpp: the models are reached through runtime/protocols.py."""
