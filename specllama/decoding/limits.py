"""How large drafts, verify batches and trees may be: one source for every part that sizes one."""

MAX_DRAFT = 16  # the controller's longest draft
# a verify batch: the newest token and the drafts. Fidelity probes measure sizes 2..MAX_VERIFY,
# costs are timed up to it, and n_rs_seq snapshots cover every draft of one
MAX_VERIFY = MAX_DRAFT + 1
# v(n) is tabulated this far past the longest draft: a tree's siblings add rows to a round
TREE_ROWS = MAX_VERIFY + 1
MAX_ROWS = MAX_DRAFT + TREE_ROWS  # the most rows one round verifies
MAX_N_DRAFT = 32  # the longest fixed draft a caller may ask for
TREE_BRANCHES = 8  # the most branches of a tree verify batch (sequences of the target's context)
AUTO_WIDTH = 3  # candidates per position the controller may verify, in auto mode
